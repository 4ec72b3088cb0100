#!/bin/sh
# One-shot namespace step of docker-compose.yml (temporalio/admin-tools image):
# wait until the server answers, create the namespace agentroster uses, and
# register the custom search attributes the agent and pool workflows upsert
# (agentroster.wire.SEARCH_ATTRIBUTES). Safe to run again: what exists is kept.
set -eu

ADDRESS=${TEMPORAL_ADDRESS:-temporal:7233}
NAMESPACE=${TEMPORAL_NAMESPACE:-default}
RETENTION=${NAMESPACE_RETENTION:-72h}
ATTEMPTS=${SETUP_ATTEMPTS:-60}

attempt=1
until temporal operator cluster health --address "$ADDRESS" >/dev/null 2>&1; do
  if [ "$attempt" -ge "$ATTEMPTS" ]; then
    echo "the Temporal server at $ADDRESS is not healthy after $ATTEMPTS attempts" >&2
    exit 1
  fi
  attempt=$((attempt + 1))
  sleep 2
done

if temporal operator namespace describe --address "$ADDRESS" --namespace "$NAMESPACE" >/dev/null 2>&1; then
  echo "namespace $NAMESPACE exists"
else
  temporal operator namespace create --address "$ADDRESS" --namespace "$NAMESPACE" --retention "$RETENTION"
  echo "namespace $NAMESPACE created (retention $RETENTION)"
fi

existing=$(temporal operator search-attribute list --address "$ADDRESS" --namespace "$NAMESPACE")
for attribute in AgentState:Keyword AgentCapabilities:KeywordList AgentDeployment:Keyword AgentPool:Keyword AgentEndReason:Keyword AgentsServed:KeywordList; do
  name=${attribute%%:*}
  type=${attribute#*:}
  if printf '%s\n' "$existing" | grep -qw "$name"; then
    echo "search attribute $name exists"
  else
    temporal operator search-attribute create --address "$ADDRESS" --namespace "$NAMESPACE" --name "$name" --type "$type"
    echo "search attribute $name ($type) created"
  fi
done
