"""A supervisor built with the OpenAI Agents SDK, run durably by Temporal, with the roster's capabilities as its tools.

`RosterSupervisorWorkflow` runs an `agents.Agent` with the Temporal integration
(`temporalio.openai_agents`, the package `temporalio-openai-agents`): every model
call is an activity, and so is every tool call. Its one tool, `use_capability`,
is the activity `RosterTools.use_capability`: it runs one task through the pool
with `AgentRoster.invoke` (lease the best agent for the capability, check the
schemas, POST with the lease token, fail over, release) and hands the output
back to the model as JSON. The model picks capabilities by name; it never sees
an agent id. A refusal from the pool (unknown capability, no agent free in time,
input that breaks the schema) goes back to the model as text, for it to act on.

With `OPENAI_API_KEY` set, the model is OpenAI's (the integration's default
provider). Without one, `ScriptedModelProvider` stands in: a model that asks
for `math.eval` on the expression in the question, then answers with the
capability's output. The tests run it that way: no network, no key.

    python -m examples.openai_agents_supervisor "What is sqrt(16) + 2**10?"
    # beside `agentroster dev` (TEMPORAL_ADDRESS, AGENTROSTER_POOL, AGENTROSTER_LEASE_KEY as it prints)
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from temporalio import activity, workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from agents import Agent, Model, ModelProvider, ModelResponse, Runner, Usage
    from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText
    from temporalio.openai_agents import workflow as agents_workflow

if TYPE_CHECKING:
    from temporalio.client import Client

    from agentroster.client.roster import AgentRoster

INSTRUCTIONS = (
    "You are a supervisor. You have no skills of your own: call `use_capability` with the name of a "
    "capability of the agent pool (for example `math.eval`, `rag.search`, `code.python.exec`) and its "
    "payload as a JSON object, then answer from what it returns."
)
TOOL_TIMEOUT = timedelta(seconds=90)


class RosterTools:
    """The activities that reach the pool: one task per call, through `AgentRoster.invoke`."""

    def __init__(self, roster: AgentRoster, *, wait_s: float = 30.0) -> None:
        self.roster = roster
        self.wait_s = wait_s

    @activity.defn
    async def use_capability(self, capability: str, payload_json: str) -> str:
        """Run one task on an agent of the pool that serves `capability` (a name such as `math.eval`, or a
        ref such as `math.eval@>=1,<2`) with `payload_json` (a JSON object), and return the agent's output as JSON."""
        from agentroster.errors import AgentRosterError

        try:
            payload = json.loads(payload_json)
        except ValueError as exc:
            return f"error: payload_json is not JSON: {exc}"
        try:
            output = await self.roster.invoke(capability, payload, timeout=self.wait_s)
        except (AgentRosterError, ValueError) as exc:
            return f"error: {type(exc).__name__}: {exc}"
        return json.dumps(output)


@workflow.defn
class RosterSupervisorWorkflow:
    """An OpenAI Agents SDK agent whose tools are the roster's capabilities; its answer is the result."""

    @workflow.run
    async def run(self, question: str) -> str:
        tool = agents_workflow.activity_as_tool(
            RosterTools.use_capability,
            start_to_close_timeout=TOOL_TIMEOUT,
            # `AgentRoster.invoke` fails over between agents itself; a retry here would run the task again.
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
        agent = Agent(name="supervisor", instructions=INSTRUCTIONS, tools=[tool])
        result = await Runner.run(agent, question)
        return str(result.final_output)


# ------------------------------------------------------------------ the scripted model


def _message(text: str) -> ModelResponse:
    output = ResponseOutputMessage(
        id="msg", role="assistant", status="completed", type="message",
        content=[ResponseOutputText(text=text, annotations=[], type="output_text")],
    )
    return ModelResponse(output=[output], usage=Usage(), response_id=None)


def _tool_call(name: str, arguments: dict[str, Any]) -> ModelResponse:
    call = ResponseFunctionToolCall(
        arguments=json.dumps(arguments), call_id=f"call-{uuid.uuid4().hex[:8]}", name=name, type="function_call", id="fc", status="completed"
    )
    return ModelResponse(output=[call], usage=Usage(), response_id=None)


class ScriptedModel(Model):
    """A model without a network: first it asks for `math.eval` on the expression the question
    names ("What is EXPRESSION?"), then it answers with what the tool returned."""

    async def get_response(self, system_instructions: str | None, input: Any, *args: Any, **kwargs: Any) -> ModelResponse:
        items = [input] if isinstance(input, str) else list(input)
        outputs = [i.get("output") for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"]
        if outputs:
            return _message(f"The math.eval capability answered: {outputs[-1]}")
        question = items[0] if isinstance(items[0], str) else str(items[0].get("content", ""))
        match = re.search(r"what is (.+?)\??$", question.strip(), re.IGNORECASE)
        if match is None:
            return _message("I can only ask the pool to evaluate expressions: ask 'What is EXPRESSION?'")
        payload = json.dumps({"expression": match.group(1)})
        return _tool_call("use_capability", {"capability": "math.eval@>=1,<2", "payload_json": payload})

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the scripted model does not stream")


class ScriptedModelProvider(ModelProvider):
    """Every model name gives the scripted model."""

    def get_model(self, model_name: str | None) -> Model:
        return ScriptedModel()


# ----------------------------------------------------------------- running it


async def supervisor_client(address: str, namespace: str = "default", *, model_provider: ModelProvider | None = None) -> Client:
    """A Temporal client with the OpenAI Agents plugin: its workers run model calls as activities."""
    from temporalio.client import Client
    from temporalio.openai_agents import ModelActivityParameters, OpenAIAgentsPlugin

    plugin = OpenAIAgentsPlugin(
        model_params=ModelActivityParameters(start_to_close_timeout=timedelta(seconds=60)), model_provider=model_provider
    )
    return await Client.connect(address, namespace=namespace, plugins=[plugin])


async def ask(
    client: Client, roster: AgentRoster, question: str, *, task_queue: str | None = None, workflow_id: str | None = None
) -> str:
    """Run `RosterSupervisorWorkflow` on a worker of its own (on `task_queue`) and return its answer."""
    from temporalio.worker import Worker

    task_queue = task_queue or f"supervisor-{uuid.uuid4().hex[:8]}"
    tools = RosterTools(roster)
    async with Worker(client, task_queue=task_queue, workflows=[RosterSupervisorWorkflow], activities=[tools.use_capability]):
        return await client.execute_workflow(
            RosterSupervisorWorkflow.run, question, id=workflow_id or f"supervisor-{uuid.uuid4().hex}", task_queue=task_queue
        )


async def _main(question: str) -> None:
    from agentroster.client.roster import AgentRoster
    from agentroster.client.settings import Settings

    settings = Settings.from_env()
    provider = None if os.environ.get("OPENAI_API_KEY") else ScriptedModelProvider()
    client = await supervisor_client(settings.address, settings.namespace, model_provider=provider)
    async with AgentRoster.connect(settings.address, namespace=settings.namespace, pool=settings.pool, ensure_pool=False) as roster:
        print(await ask(client, roster, question))


if __name__ == "__main__":
    asyncio.run(_main(" ".join(sys.argv[1:]) or "What is sqrt(16) + 2**10?"))
