"""OpenAI's endpoints: chat and completions (routes, with the answers they show: answers, chat_shapes,
completion_shapes, logprob_shapes), embeddings, /v1/models and loading (model_routes), /tokenize and
/detokenize (token_routes)."""
