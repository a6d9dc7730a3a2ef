"""One data-plane call, whatever its API: chat completions (`chat`), Responses and Messages run as chat
(`translated`), token completions (`completions`); the engine call and its exact recording (`engine_call`); the chat
template and exact-token splicing (`chat_format`, `control_tokens`); `tool_choice` resolved and forced."""
