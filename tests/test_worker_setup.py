"""The worker's start-up check of the custom search attributes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import ListSearchAttributesResponse
from temporalio.service import RPCError, RPCStatusCode

from agentroster.client.search_attributes import MissingSearchAttributesError, ensure_search_attributes


async def test_dev_server_has_every_attribute_after_the_check(dev_env) -> None:
    await ensure_search_attributes(dev_env.client)
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest

    listed = await dev_env.client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace="default"))
    custom = dict(listed.custom_attributes)
    assert custom["AgentState"] == IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD
    assert custom["AgentCapabilities"] == IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD_LIST
    assert custom["AgentDeployment"] == IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD
    assert custom["AgentPool"] == IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD


class RefusingOperator:
    """Stands in for a server (e.g. Temporal Cloud) that lists but will not add attributes:
    no such server runs here, so its two answers are reproduced."""

    def __init__(self, present: dict[str, int]) -> None:
        self.present = present

    async def list_search_attributes(self, request):  # noqa: ANN001
        return ListSearchAttributesResponse(custom_attributes=self.present)

    async def add_search_attributes(self, request):  # noqa: ANN001
        raise RPCError("permission denied", RPCStatusCode.PERMISSION_DENIED, b"")


async def test_refused_registration_names_the_missing_attributes() -> None:
    client = SimpleNamespace(namespace="prod", operator_service=RefusingOperator({"AgentState": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD}))
    with pytest.raises(MissingSearchAttributesError) as caught:
        await ensure_search_attributes(client)  # type: ignore[arg-type]
    text = str(caught.value)
    assert "AgentCapabilities" in text and "AgentDeployment" in text and "AgentPool" in text
    assert "AgentState (" not in text  # present: not reported missing
    assert "temporal operator search-attribute create --namespace prod --name AgentCapabilities --type KeywordList" in text


async def test_attribute_of_the_wrong_type_is_reported() -> None:
    client = SimpleNamespace(namespace="prod", operator_service=RefusingOperator({"AgentState": IndexedValueType.INDEXED_VALUE_TYPE_TEXT}))
    with pytest.raises(MissingSearchAttributesError, match="AgentState is INDEXED_VALUE_TYPE_TEXT"):
        await ensure_search_attributes(client)  # type: ignore[arg-type]
