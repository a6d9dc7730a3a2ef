"""`marl proxy`: train a model on an existing application's live traffic.

The app calls what it takes for an ordinary OpenAI endpoint. Behind it, every request is answered N times by the
trainable model, one episode each on the swarm server under one task id; a reward function scores the N answers
against each other; the episodes are ended with those rewards (a GRPO group); the best answer goes back to the app.

    cli            the command line: `add_proxy_parser`/`run_proxy` for `marl proxy`, `main` for `python -m marl.proxy`
    app            the HTTP routes, the app's API key, OpenAI-shaped errors
    service        one request: lease, generate, score, settle, answer; held conversations
    leases         begin/end/abort on the swarm server, all-or-nothing, with a bounded wait
    candidates     the request sent through each lease
    conversations  the winner's lease held for the app's next turn
    rewards        the reward-function contract, `module:function` loading, the `rule` and `judge` built-ins
    stream         the chosen answer as server-sent events
    metrics        Prometheus counts at /metrics

Design, multi-turn ledger and failure handling: docs/proxy.md.
"""

from marl.proxy.cli import add_proxy_parser, run_proxy

__all__ = ["add_proxy_parser", "run_proxy"]
