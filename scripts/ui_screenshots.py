"""Screenshots of what an operator sees in the Temporal UI, for the docs (docs/*.png).

Starts a dev server with its UI, a worker, two agents (one busy), then opens the
agent's and the pool's pages in headless Chromium (Debian's `chromium`, driven by
Playwright) and saves `docs/ui-agent.png` and `docs/ui-pool.png`. `tests/test_ui_browser.py`
runs the same steps and checks the text on the pages.

    python scripts/ui_screenshots.py [--out docs]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from temporalio.contrib.pydantic import pydantic_data_converter  # noqa: E402
from temporalio.testing import WorkflowEnvironment  # noqa: E402

from agentroster.activities.backend import NoneBackend  # noqa: E402
from agentroster.client.roster import AgentRoster  # noqa: E402
from agentroster.models import AgentRegistration, Capability  # noqa: E402
from agentroster.vocabulary.wire import SEARCH_ATTRIBUTES, agent_workflow_id, pool_workflow_id  # noqa: E402
from agentroster.workers.devserver import DEV_SERVER_DYNAMIC_CONFIG, temporal_cli_path  # noqa: E402
from agentroster.ops.ports import free_port  # noqa: E402
from agentroster.workers.worker import create_worker  # noqa: E402


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@dataclass
class UiStack:
    env: WorkflowEnvironment
    ui_port: int
    roster: AgentRoster

    async def page_url(self, workflow_id: str) -> str:
        run_id = (await self.env.client.get_workflow_handle(workflow_id).describe()).run_id
        return f"http://127.0.0.1:{self.ui_port}/namespaces/default/workflows/{urllib.parse.quote(workflow_id, safe='')}/{run_id}/history"


@asynccontextmanager
async def ui_stack(pool: str = "default") -> AsyncIterator[UiStack]:
    """A dev server with its UI, a worker, and two registered agents (one of them leased)."""
    ui_port = free_port()
    env = await WorkflowEnvironment.start_local(
        port=free_port(),
        dev_server_existing_path=temporal_cli_path(),
        dev_server_extra_args=list(DEV_SERVER_DYNAMIC_CONFIG),
        data_converter=pydantic_data_converter,
        search_attributes=SEARCH_ATTRIBUTES,
        ui=True,
        ui_port=ui_port,
    )
    worker = create_worker(env.client, task_queue="agentroster", backend=NoneBackend())
    task = asyncio.create_task(worker.run())
    try:
        roster = AgentRoster(env.client, pool=pool, task_queue="agentroster")
        for agent_id, caps in (("search-agent-7f9c", [("rag.search", "2.1.0", 2, "B")]), ("math-agent-2k4d", [("math.eval", "1.0.0", 1, "A")])):
            await roster.register(AgentRegistration(
                agent_id=agent_id,
                deployment=agent_id.rsplit("-", 1)[0],
                endpoint=f"http://10.1.0.{len(agent_id)}:8080",
                capabilities=[Capability(name=n, version=v, max_concurrency=m, cost_class=c) for n, v, m, c in caps],  # type: ignore[arg-type]
            ))
        await roster.acquire("rag.search", timeout=5)
        yield UiStack(env, ui_port, roster)
    finally:
        await worker.shutdown()
        await task
        await env.shutdown()


async def open_page(browser: Any, url: str, wait_for: str, tab: str | None = None) -> Any:
    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    await page.goto(url)
    await page.get_by_text(wait_for).first.wait_for(timeout=45_000)
    if tab:
        await page.get_by_role("tab", name=tab).or_(page.get_by_text(tab, exact=True)).first.click()
        await page.wait_for_timeout(1500)
    return page


async def main(out: Path) -> int:
    from playwright.async_api import async_playwright

    browser_path = chromium_path()
    if browser_path is None:
        print("no chromium on PATH: apt-get install chromium", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    async with ui_stack() as stack, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        agent = await open_page(browser, await stack.page_url(agent_workflow_id("default", "search-agent-7f9c")), "agent search-agent-7f9c", "User Metadata")
        await agent.screenshot(path=str(out / "ui-agent.png"))
        pool = await open_page(browser, await stack.page_url(pool_workflow_id("default")), "pool default", "User Metadata")
        await pool.screenshot(path=str(out / "ui-pool.png"))
        await browser.close()
    print(f"saved {out / 'ui-agent.png'} and {out / 'ui-pool.png'}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs")
    sys.exit(asyncio.run(main(parser.parse_args().out)))
