"""glm-serve: an OpenAI-compatible HTTP server over glmkit.runtime (routes in app, the generation worker in
scheduler, GLM tool-call text in toolcalls, the command line in cli)."""
