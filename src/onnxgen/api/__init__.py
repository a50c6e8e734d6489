"""OpenAI protocol logic independent of the HTTP framework: request models, response bodies, events.

- :mod:`onnxgen.api.responses`: the ``/v1/responses`` request and the response object.
- :mod:`onnxgen.api.responses_input`: Responses input items (and a stored conversation) as chat messages.
- :mod:`onnxgen.api.response_object`: the response object and its output items.
- :mod:`onnxgen.api.responses_events`: the streaming event sequence and the final response, built from
  parsed reply deltas.
- :mod:`onnxgen.api.store`: the bounded in-memory store behind ``previous_response_id``.
- :mod:`onnxgen.api.chat`: Chat Completions message, delta and logprobs bodies.
"""
