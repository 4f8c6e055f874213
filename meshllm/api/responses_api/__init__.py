"""OpenAI's Responses API (POST /v1/responses and its stored responses) over the chat machinery.

A Responses request is the same job as a chat completion written differently: `input` items
(messages, function calls, their outputs) and `instructions` become chat messages, flat
function tools and `text.format` become `tools` and `response_format`. So a request is
converted (requests.py), run as one chat choice through the very code chat completions use
(prompt rendering, grammars for forced calls and JSON schemas, the tool-call parser), and its
content and call deltas are re-shaped into output items (output.py): whole, or as the
Responses stream's typed events (stream.py). Responses are kept (store.py) so a later request
can continue one by `previous_response_id`, as agent frameworks and the OpenAI Agents SDK do.
"""
