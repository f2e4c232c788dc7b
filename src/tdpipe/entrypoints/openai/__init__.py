"""The OpenAI-compatible HTTP server (`tdpipe serve`): api_server.build_app(engine, ServerConfig) is the
factory; protocol holds the request/response models, serving* turn requests into engine calls."""
