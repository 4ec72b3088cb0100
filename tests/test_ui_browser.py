"""A real headless browser on the dev server's Temporal UI (issue 9's check).

Debian's `chromium`, driven by Playwright (its own browser download cannot reach
the internet here): the agent's page shows its summary and current details, the
pool's page its counts. `.ci/run` installs chromium when it can (root and apt-get);
where it cannot, this test skips with the reason and `scripts/ui_screenshots.py`
is the way to look.
"""

from __future__ import annotations

import pytest

from scripts.ui_screenshots import chromium_path, open_page, ui_stack
from agentroster.vocabulary.wire import agent_workflow_id, pool_workflow_id

playwright = pytest.importorskip("playwright.async_api", reason="playwright is not installed (pip install -e '.[dev]')")


@pytest.mark.slow
@pytest.mark.skipif(chromium_path() is None, reason="no chromium on PATH (apt-get install chromium; .ci/run does it as root)")
async def test_the_ui_shows_the_agents_summary_and_current_details(tmp_path) -> None:  # noqa: ANN001
    async with ui_stack(pool="ui") as stack, playwright.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        try:
            agent = await open_page(browser, await stack.page_url(agent_workflow_id("ui", "search-agent-7f9c")), "agent search-agent-7f9c", "User Metadata")
            text = await _all_text(agent, "last heartbeat")
            assert "agent search-agent-7f9c of search-agent: rag.search@2.1.0" in text  # the summary
            assert "Ready" in text and "capacity 2" in text and "last heartbeat" in text  # current details
            await agent.screenshot(path=str(tmp_path / "agent.png"))
            pool = await open_page(browser, await stack.page_url(pool_workflow_id("ui")), "pool ui", "User Metadata")
            text = await _all_text(pool, "active lease(s)")
            assert "2 agent(s)" in text and "1 active lease(s)" in text
        finally:
            await browser.close()


async def _all_text(page, expect: str, timeout_s: float = 30.0) -> str:  # noqa: ANN001
    """The page's text with its frames': the UI renders summaries and details in iframes."""
    text = ""
    for _ in range(int(timeout_s * 2)):
        parts = []
        for frame in page.frames:
            try:
                parts.append(await frame.inner_text("body"))
            except Exception:  # a frame still loading  # noqa: BLE001
                continue
        text = "\n".join(parts)
        if expect in text:
            return text
        await page.wait_for_timeout(500)
    return text
