"""`marl proxy`: the command line (`add_proxy_parser` for `marl`'s own parser, `main` for `python -m marl.proxy`).

Startup checks the swarm server before serving: it must be a trainable server, and N (--num-repeat, default the
server's num_repeat) at least its num_repeat, or GRPO groups would never fill. With --train-config the proxy syncs that
config and starts the engine first (idempotent: safe when it already runs that config).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from marl.protocol import ADMIN_TOKEN_ENV, SERVER_KEEP_ALIVE_S, TrainConfig

API_KEY_ENV = "MARL_PROXY_API_KEY"
DEFAULT_PORT = 10087
REACH_TIMEOUT_S = 5.0  # how long start-up tries to reach the swarm server before saying it cannot


class StartupError(Exception):
    """The proxy cannot start: the message says why and what to do."""


def add_proxy_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `proxy` to `marl`'s subcommands."""
    parser = subparsers.add_parser(
        "proxy", help="train on an existing app's traffic: an OpenAI endpoint answering with the best of N",
        description=_DESCRIPTION)
    add_arguments(parser)
    parser.set_defaults(func=run_proxy)
    return parser


_DESCRIPTION = ("Serve /v1/chat/completions to an existing app. Each request is answered N times by the trainable"
                " model (one episode each on the swarm server, one task id), the answers are scored against each other"
                " by the reward function, the episodes are ended with those rewards (a GRPO group), and the best"
                " answer goes back to the app. See docs/proxy.md.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", required=True, help="the swarm server's URL, e.g. http://127.0.0.1:10086")
    parser.add_argument("--admin-token-env", default=ADMIN_TOKEN_ENV, metavar="VAR",
                        help="environment variable holding the swarm server's admin token (default: %(default)s)")
    parser.add_argument("--api-key-env", default=API_KEY_ENV, metavar="VAR",
                        help="environment variable holding the API key the app must send (default: %(default)s;"
                             " generated and printed when unset)")
    parser.add_argument("--num-repeat", type=int, metavar="N", help="candidates per request (default: the server's"
                                                                     " num_repeat)")
    parser.add_argument("--reward", required=True, metavar="SPEC",
                        help="module:function, or a built-in: rule (pattern=, max_words=, min_words=, contains=),"
                             " judge (url=, model=, api_key_env=, criteria=)")
    parser.add_argument("--reward-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of a built-in reward (repeat for several)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 for remote apps)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--max-wait-s", type=float, default=60.0,
                        help="how long a request waits for leases while the server drains, trains or is busy; then"
                             " 503 with Retry-After (default: %(default)s)")
    parser.add_argument("--conversation-idle-s", type=float, default=30.0,
                        help="how long the winner's lease waits for the conversation's next turn (capped at half the"
                             " lease patience); 0 ends every episode at once (default: %(default)s)")
    parser.add_argument("--train-config", metavar="JSON|FILE",
                        help="a train config (JSON, or a .json/.yaml file) to sync, starting the engine")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run_proxy(args: argparse.Namespace) -> None:
    """Check the server, load the reward function, and serve until interrupted."""
    import logging

    import uvicorn

    from marl.proxy.app import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.log_level != "debug":  # httpx logs every call to the swarm server at INFO
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        options = proxy_options(args)
    except StartupError as exc:
        print(f"marl proxy: error: {exc}", file=sys.stderr)  # argparse's form, as every `marl` command says a mistake
        sys.exit(2)
    print(f"marl proxy: {options.num_repeat} candidates per request on {options.served_model!r} at {args.server};"
          f" serving http://{args.host}:{args.port}/v1", flush=True)
    _serve_until_signalled(uvicorn.Server(uvicorn.Config(build_app(options), host=args.host, port=args.port,
                                                         log_level=args.log_level,
                                                         timeout_keep_alive=SERVER_KEEP_ALIVE_S)))


def _serve_until_signalled(server: Any) -> None:
    """Serve until SIGTERM (exit 0) or Ctrl-C (exit 130), each after uvicorn's clean shutdown.

    uvicorn catches both signals, shuts down cleanly, then raises the caught signal again with the handlers it found
    at start. Under Python's default SIGTERM handler that kills the process: a clean `kill` read as exit -15 (death by
    signal) by supervisors and CI. So the proxy's own SIGTERM handler is in place: it ends the process with exit 0,
    also when SIGTERM comes before uvicorn's handlers are installed (nothing is served yet, nothing to clean up).
    """
    import signal

    def terminated(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C, re-raised by uvicorn after its clean shutdown
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)


def proxy_options(args: argparse.Namespace) -> Any:
    """`ProxyOptions` from the command line, after checking the swarm server (`StartupError` says what is wrong)."""
    from marl.proxy.app import ProxyOptions
    from marl.proxy.rewards import load_reward

    admin_token = os.environ.get(args.admin_token_env)
    if not admin_token:
        raise StartupError(f"${args.admin_token_env} is not set: it must hold the swarm server's admin token")
    api_key = os.environ.get(args.api_key_env)
    if not api_key:
        api_key = f"marl-proxy-{secrets.token_urlsafe(24)}"
        print(f"marl proxy: ${args.api_key_env} is not set; the app's API key is {api_key}", flush=True)
    try:
        reward = load_reward(args.reward, _options(args.reward_option))
        config = _train_config(args.train_config) if args.train_config else None
        num_repeat, model = check_server(args.server, admin_token, args.num_repeat, config)
        return ProxyOptions(server_url=args.server, admin_token=admin_token, api_key=api_key, reward=reward,
                            num_repeat=num_repeat, served_model=model, max_wait_s=args.max_wait_s,
                            conversation_idle_s=args.conversation_idle_s)
    except ValueError as exc:
        raise StartupError(str(exc)) from exc


def check_server(url: str, admin_token: str, num_repeat: int | None,
                 config: TrainConfig | None) -> tuple[int, str]:
    """(N, served model name) once the server is known to train and N fills its groups."""
    from marl.client import SwarmClient, SwarmError

    try:
        with SwarmClient(url, admin_token=admin_token) as client:
            status = client.status(timeout=REACH_TIMEOUT_S)  # an unreachable server or a wrong token: said at once
            if config is not None:
                client.auto_sync_train_config_and_start_engine(config)
                status = client.status()
    except SwarmError as exc:
        raise StartupError(f"swarm server {url}: {exc}") from exc
    if status.static or status.pool is None:
        raise StartupError(f"{url} is a STATIC server: it trains nothing, so there is nothing to proxy for")
    server_repeat = status.pool.num_repeat
    n = server_repeat if num_repeat is None else num_repeat
    if n < server_repeat:
        raise StartupError(f"--num-repeat {n} is below the server's num_repeat {server_repeat}: a request's group"
                           f" would never be complete, so nothing would train. Use --num-repeat >= {server_repeat}")
    return n, status.model


def _options(pairs: list[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--reward-option {pair!r}: expected KEY=VALUE")
        options[key] = value
    return options


def _train_config(text: str) -> TrainConfig:
    """`--train-config`: a YAML/JSON file or inline JSON, typed here (a bad key is a ValueError naming it)."""
    path = Path(text)
    if path.is_file():
        import yaml

        data = yaml.safe_load(path.read_text())  # YAML is a superset of JSON
    else:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--train-config: neither a file nor JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError("--train-config must be a mapping of TrainConfig fields")
    return TrainConfig.model_validate(data)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="marl proxy", description=_DESCRIPTION)
    add_arguments(parser)
    run_proxy(parser.parse_args(argv))
