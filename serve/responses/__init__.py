"""OpenAI's Responses API (``POST /v1/responses`` and its store) on the chat endpoint's paths:
protocol models (protocol.py), conversion to chat messages (convert.py), the response objects
and stream events (objects.py), the sqlite store (store.py) and the handlers (handler.py)."""
