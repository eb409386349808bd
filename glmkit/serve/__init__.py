"""glm-serve: an OpenAI-compatible HTTP server over a converted snapshot.

app (routes and the app factory), config (settings, shared state), auth (API key), protocol (OpenAI's wire
format: errors, field checks, response pieces), chat (messages and tools in, a reply's parts out), bridge (the
worker <-> asyncio channel), scheduler (the generation worker), toolcalls (GLM tool-call text); the command
line is glmkit.cli.serve.
"""
