"""Example agents and an example supervisor for agentroster.

Run an agent with `python -m examples.math_agent` (or `search_agent`,
`code_agent`); configure it with the environment (see
`agentroster.agent.runtime.AgentRuntime.from_env`). `python -m examples.supervisor`
runs the example plan against a running pool; `python -m examples.openai_agents_supervisor`
asks a question of an OpenAI Agents SDK agent whose tools are the pool's capabilities.
"""
