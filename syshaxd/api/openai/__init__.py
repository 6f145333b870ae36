"""OpenAI's endpoints: chat and completions (routes, with the answers they show: answers, chat_shapes,
completion_shapes, logprob_shapes), embeddings, rerank (llama-server's /v1/rerank) and their OpenAPI schemas
(vector_schemas), /v1/models and loading (model_routes), /tokenize and /detokenize (token_routes)."""
