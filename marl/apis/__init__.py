"""The data plane's APIs besides chat completions, as translations to and from chat completions.

`messages` (Anthropic Messages) and `responses` (OpenAI Responses) each define their wire format and translate a
request into a `marl.protocol.ChatCompletionRequest`, and a chat completion (whole, or as it streams) back into their
own reply and events. Both halves use them: the swarm server (`servers/http/routes.py`), so that every API reaches
the engine through the one chat path and is recorded exactly as chat completions are, and `marl proxy`, which answers
these APIs with the best of N chat-completion candidates. Like `marl.protocol`, they import nothing else of the
project.
"""
