"""The API's shared core: one generation loop for every endpoint (generation, outputs, sse, fanout), request
validation (validate, fields, constraints, structured, tools, reasoning, long_strings), errors, the app's
state and keys, API keys (auth), the connection cap (connections), and the forwarding of a request to a
chat model's daemon (model_proxy). Every surface stands on it."""
