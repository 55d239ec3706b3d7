"""``swarm serve``: a glued model behind HTTP completions in the OpenAI API's shape.

- :mod:`~agent.serve.kvcache`: the model's steppers: with a KV cache (each new token costs
  one position) or without (each token recomputes the window);
- :mod:`~agent.serve.engine`: one thread that batches every running request's next token
  into one call;
- :mod:`~agent.serve.text`: tokens to text, streamed, with stop sequences;
- :mod:`~agent.serve.api`: the request and response types;
- :mod:`~agent.serve.app`: the Litestar app (``/v1/completions``, ``/v1/models``,
  ``/health``, ``/metrics``) and :mod:`~agent.serve.main`, the process.

TensorFlow is imported only where a model runs (the steppers, and the process once it loads
the model).
"""
