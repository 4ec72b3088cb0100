"""A trivial workflow whose no-op update is the floor of every update round trip."""

from temporalio import workflow


@workflow.defn(name="NoopWorkflow")
class NoopWorkflow:
    """The floor: an update that does nothing."""

    def __init__(self) -> None:
        self._stop = False

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: self._stop)

    @workflow.update
    def noop(self) -> int:
        return 0

    @workflow.signal
    def ping(self) -> None:
        """A signal that does nothing (the floor of a release signal)."""

    @workflow.signal
    def stop(self) -> None:
        self._stop = True
