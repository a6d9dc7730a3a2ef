"""AgentScope agents play Werewolves through the coordinator, on a running trainable swarm server.

    pip install -e ".[agentscope]"
    marl serve --model smollm2-135m --port 8000 --admin-token "$MARL_ADMIN_TOKEN" &
    python examples/agentscope_werewolves.py --server http://127.0.0.1:8000 --roles werewolf,seer --games 4

The roles in --roles are played by AgentScope agents on the server (each game is one leased episode there; the calls
are recorded under their role and get that role's reward). Every other role is scripted by the env, or played by
AgentScope agents on the --fallback-url model (any OpenAI-compatible endpoint; not trained) if one is given.
Env arguments: --env-arg max_rounds=3. Another game: --env envs.signalling:SignallingGame --roles speaker,listener.
"""

from __future__ import annotations

import argparse
import os
import sys
from itertools import islice

import yaml

from marl import ADMIN_TOKEN_ENV, SwarmClient, SwarmError, TrainConfig
from marl.agents.agentscope import Fallback, agentscope_players
from marl.games.schedule import tasks
from marl.runner.endpoints import TrainableEndpoint
from marl.topology import import_env_factory
from marl.transaction.coordinator import Coordinator, GameFailed, GameSettings

SERVER = "server"  # the swarm server's name in the coordinator


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True, help="URL of a running trainable `marl serve` swarm server")
    parser.add_argument("--admin-token", default=os.environ.get(ADMIN_TOKEN_ENV),
                        help=f"the server's admin token (default: ${ADMIN_TOKEN_ENV})")
    parser.add_argument("--roles", default="werewolf,seer", help="roles played by AgentScope agents on the server")
    parser.add_argument("--games", type=int, default=2)
    parser.add_argument("--env", default="envs.werewolves:Werewolves",
                        help="the env class or factory, module:name")
    parser.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="an argument of the env class, e.g. max_rounds=3 (repeatable; VALUE is read as YAML)")
    parser.add_argument("--repeats", type=int, default=2, help="games per task (the server's GRPO group size)")
    parser.add_argument("--batch-size", type=int, default=4, help="GRPO groups per training step on the server")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fallback-url", help="an OpenAI-compatible base URL for the other roles (default: scripted)")
    parser.add_argument("--fallback-model", default="default", help="the model name at --fallback-url")
    parser.add_argument("--fallback-api-key", default=os.environ.get("MARL_FALLBACK_API_KEY", "none"),
                        help="the API key at --fallback-url (default: $MARL_FALLBACK_API_KEY)")
    return parser.parse_args(argv)


def ours_and_theirs(env, roles: str) -> tuple[dict[str, str | None], list[str]]:
    """Role -> SERVER for the roles the AgentScope agents play, None (scripted or fallback) for the others."""
    dealt = env.dealt_roles()  # every role the env deals, known before any game
    ours = [role.strip() for role in roles.split(",") if role.strip()]
    unknown = [role for role in ours if role not in dealt]
    if unknown:
        raise SystemExit(f"error: the env deals no role {unknown}; its roles: {sorted(dealt)}")
    return {role: SERVER if role in ours else None for role in dealt}, ours


def play(coordinator: Coordinator, games: list[tuple[str, int]]) -> int:
    """Play the games one by one, printing each result; returns how many failed."""
    failed = 0
    for task_id, seed in games:
        try:
            result = coordinator.play_game(task_id, seed)
        except GameFailed as exc:
            print(f"{task_id} (seed {seed}) failed: {exc}")
            failed += 1
            continue
        rewards = sorted(result.role_rewards.items(), key=lambda item: -item[1])
        print(f"{task_id} (seed {seed}): " + (f"winner {result.winner}, " if result.winner else "")
              + f"{result.turns} turns, {result.seconds:.1f}s, rewards "
              + ", ".join(f"{role} {reward:+.2f}" for role, reward in rewards)
              + f"; episode {result.episodes[SERVER]} at policy version {result.policy_versions[SERVER]}")
    return failed


def build(args: argparse.Namespace, client: SwarmClient) -> tuple[Coordinator, TrainConfig, list[str]]:
    """The coordinator of the games on `client`'s server, the config that server trains, and the roles the AgentScope
    agents play there. Nothing is asked of the server yet."""
    make_env = import_env_factory(args.env)
    env_args = {key: yaml.safe_load(value) for key, _, value in (arg.partition("=") for arg in args.env_arg)}
    role_servers, ours = ours_and_theirs(make_env(**env_args), args.roles)
    config = TrainConfig(job="agentscope", batch_size=args.batch_size, num_repeat=args.repeats)
    fallback = Fallback(args.fallback_url, args.fallback_model, args.fallback_api_key) if args.fallback_url else None
    coordinator = Coordinator(
        env_factory=lambda: make_env(**env_args),
        role_servers=role_servers,
        endpoints={SERVER: TrainableEndpoint(SERVER, client=client, train_config=config)},
        settings=GameSettings(max_tokens=args.max_tokens, temperature=args.temperature),
        player_factory=agentscope_players(fallback),
    )
    return coordinator, config, ours


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.admin_token:
        print(f"error: give the server's admin token (--admin-token or ${ADMIN_TOKEN_ENV})", file=sys.stderr)
        return 2
    client = SwarmClient(args.server, admin_token=args.admin_token)
    coordinator, config, ours = build(args, client)
    try:
        # The server trains this config (synced, and its engine started, if it is not running yet).
        client.auto_sync_train_config_and_start_engine(config)
    except SwarmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        coordinator.close()
        client.close()
        return 2
    others = "the fallback model" if args.fallback_url else "scripted"
    print(f"{args.env}: {', '.join(ours)} played by AgentScope agents on {args.server}; other roles {others}")
    try:
        failed = play(coordinator, list(islice(tasks("agentscope", args.repeats, args.seed), args.games)))
    finally:
        coordinator.abort_all()  # leases of a game interrupted by Ctrl-C
        coordinator.close()
        client.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
