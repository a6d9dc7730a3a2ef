"""The `marl` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import NoReturn


def _gigabytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of GB >= 0, got {text!r}")
    return value


def _megabytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of MB > 0, got {text!r}")
    return value


def _serve(args: argparse.Namespace) -> None:
    # marl/ imports servers/ only in the server-side commands: `serve` (starting a server process is what it is
    # for) and `episode` (reading a server's ledger).
    from servers.entrypoint import listen_socket, serve
    from servers.model_files import check_model

    try:
        options = _serve_options(args)
        # before the port is taken and anything loads: a typo, or a Hugging Face id not to be had, ends here in one line
        check_model(options.model, options.revision)
        sock = listen_socket(options.host, options.port)
    except ValueError as exc:
        print(f"marl serve: error: {exc}", file=sys.stderr)  # argparse's form: `marl run` finds it in the log
        sys.exit(2)
    serve(options, sock)


def _serve_options(args: argparse.Namespace):
    """`marl serve`'s arguments as `ServeOptions`; ValueError naming the flag for a bad --vllm-* value."""
    from servers.entrypoint import ServeOptions

    return ServeOptions(
        model=args.model, revision=args.revision, port=args.port, host=args.host, admin_token=args.admin_token,
        data_dir=Path(args.data_dir) if args.data_dir else None, static=args.static,
        served_model_name=args.served_model_name, public_url=args.public_url, device=args.device,
        prefix_cache_gb=args.prefix_cache_gb, engine=args.engine, simulated_speed=args.simulated_speed,
        vllm=_vllm_settings(args),
        placement=_placement(args), max_body_mb=args.max_body_mb, log_level=args.log_level,
        policies=_policies(args.policy), adapter=Path(args.adapter) if args.adapter else None,
    )


def _policies(flags: list[str]) -> dict:
    """--policy NAME[=JSON] flags as `LoraSpec`s by name; ValueError naming the flag of a bad one."""
    from pydantic import TypeAdapter, ValidationError

    from marl.protocol import LoraSpec, PolicyName

    policies = {}
    for flag in flags:
        name, _, lora = flag.partition("=")
        if name in policies:
            raise ValueError(f"--policy {name}: given twice")
        try:
            TypeAdapter(PolicyName).validate_python(name)
            policies[name] = LoraSpec.model_validate_json(lora) if lora else LoraSpec()
        except ValidationError as exc:
            raise ValueError(f"--policy {flag}: {exc.errors()[0]['msg']}") from None
    return policies


def _placement(args: argparse.Namespace):
    """--engine-gpus, --trainer-gpus, --ray-group, --ray-address as a `Placement` (ValueError: bad flag)."""
    from servers.placement import Placement

    gpus = {key: tuple(value) for key in ("engine_gpus", "trainer_gpus") if (value := getattr(args, key)) is not None}
    if gpus and args.device == "cpu":
        raise ValueError(f"{', '.join('--' + key.replace('_', '-') for key in gpus)}: --device cpu uses no GPU")
    if args.trainer_nodes not in (None, 1):
        raise ValueError("--trainer-nodes: deprecated; ranks on other machines are Ray actors in the server's"
                         " placement group now (--ray-group, which `marl run` with run.ray passes; docs/ray.md)")
    for flag in ("trainer_nodes", "rendezvous_port"):
        if getattr(args, flag) is not None:  # said on stderr: Python hides a DeprecationWarning of a console script
            print(f"marl serve: warning: --{flag.replace('_', '-')} is deprecated and not used (ranks on other"
                  " machines are Ray actors now: docs/ray.md)", file=sys.stderr)
    given = [flag for flag, used in (("--ray-address", args.ray_address), ("--no-ray-ranks", not args.ray_ranks))
             if used]  # fmt: skip
    if given and not args.ray_group:
        raise ValueError(f"{', '.join(given)}: only with --ray-group")
    return Placement(**gpus, ray_group=args.ray_group, ray_address=args.ray_address, ray_ranks=args.ray_ranks)


def _gpu_list(text: str) -> list[int]:
    from marl.protocol import parse_gpu_list

    try:
        return parse_gpu_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _trainer_node(args: argparse.Namespace) -> None:
    """Deprecated: the ranks of other machines are Ray actors now (docs/ray.md)."""
    print("marl trainer-node is deprecated and no longer runs ranks: a trainer's ranks on other machines are Ray actors"
          " in the server's placement group now. Start a Ray cluster (`ray start --head` here, `ray start"
          " --address=HEAD:6379` on each other machine), give the server placement.nodes and the trainer's"
          " rank_resources, and run `marl run FILE run.ray.address=auto` (docs/ray.md, \"A cluster of your own\").",
          file=sys.stderr)
    sys.exit(2)


#: The `VLLMSettings` that `--vllm-KEY` flags set (--vllm-arg, repeated, gives extra_args).
_VLLM_KEYS = ("max_model_len", "gpu_memory_utilization", "kv_cache_gb", "tensor_parallel_size", "data_parallel_size",
              "dtype", "max_num_seqs", "sleep_between_steps", "weight_sync")


def _vllm_flag(key: str) -> str:
    return "--vllm-arg" if key == "extra_args" else f"--vllm-{key.replace('_', '-')}"


def _vllm_settings(args: argparse.Namespace):
    """The --vllm-* flags as `VLLMSettings` (None when none is given); ValueError naming the flag of a bad value."""
    from servers.engines.vllm_process import VLLMSettings, VLLMSettingsError

    given = {key: getattr(args, f"vllm_{key}") for key in _VLLM_KEYS if getattr(args, f"vllm_{key}") is not None}
    if args.vllm_arg:
        given["extra_args"] = tuple(args.vllm_arg)
    if not given:
        return None
    if args.engine != "vllm":
        raise ValueError(f"{', '.join(map(_vllm_flag, given))}: only with --engine vllm (add it, or drop them)")
    sleep = given.pop("sleep_between_steps", "auto")
    try:
        return VLLMSettings(**given, sleep_between_steps={"auto": None, "true": True, "false": False}[sleep])
    except VLLMSettingsError as exc:
        raise ValueError("; ".join(f"{_vllm_flag(key)}: {message}" for key, message in exc.problems)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _swarm_url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected a server's URL such as http://127.0.0.1:10086, got {text!r}"
                                         " (add http://)")
    return text


def _status(args: argparse.Namespace) -> None:
    from marl.client import SwarmClient

    # A short timeout: an unreachable server is said within seconds, not after the client's 30 s (SwarmTimeout).
    with SwarmClient(args.url, admin_token=args.admin_token, timeout=args.timeout) as client:
        print(json.dumps(client.status().model_dump(mode="json"), indent=2))


def _topology_show(args: argparse.Namespace) -> None:
    from rich.console import Console

    from marl.topology import Topology
    from marl.watching.topology_view import topology_tree

    topology = Topology.load(args.file, args.overrides, check_env=not args.no_env_check)  # TopologyError: main()
    # Piped output: no colours (rich drops them) and no wrapping at 80 columns.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    console.print(topology_tree(topology))


def _run(args: argparse.Namespace) -> None:
    from marl.runner.launch import ServerStartError
    from marl.runner.run import run

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        summary = run(args.file, args.overrides)  # a TopologyError is a mistake in what was asked: main() says it
    except ServerStartError as exc:  # a taken port, a model that does not load, a server that died booting
        print(f"marl run: {exc}", file=sys.stderr)
        sys.exit(1)
    if summary.interrupted:
        sys.exit(130)
    if summary.error:
        sys.exit(1)


def _overwatch(args: argparse.Namespace) -> None:
    from marl.watching.overwatch import OverwatchApp, print_once, resolve_sources

    sources = resolve_sources(args.targets, args.admin_token)  # OverwatchError, TopologyError: main()
    if args.once:
        unread = print_once(sources)
        if unread:  # each panel says why; a script reading --once learns it from the exit code too
            _fail(args, f"{len(unread)} of {len(sources)} servers could not be read ({', '.join(unread)}): see"
                        " their panels above for why")
    else:
        OverwatchApp(sources, interval_s=args.interval).run()


def _plot(args: argparse.Namespace) -> None:
    from marl.watching.plot import plot_run

    try:
        written = plot_run(Path(args.run_dir))
    except FileNotFoundError as exc:
        print(f"marl plot: {exc}", file=sys.stderr)
        sys.exit(2)
    if not written:
        print(f"marl plot: nothing to plot in {args.run_dir} yet (no games.jsonl, no servers/*/metrics.jsonl)",
              file=sys.stderr)
        sys.exit(1)
    for path in written:
        print(path)


def _episode(args: argparse.Namespace) -> None:
    # Reading a server's ledger is a server-side tool, like `serve`.
    from servers.episodes.view import list_episodes, show_episode

    if args.episode_command == "list":  # a ViewerError (no ledger there, no such episode): main()
        list_episodes(Path(args.data_dir), limit=args.limit)
    else:
        show_episode(Path(args.data_dir), args.episode_id, model=args.model, tokens=args.tokens)


def _check_env(args: argparse.Namespace) -> None:
    # The check reads the server's ledger, as `marl episode` does: the reader goes in from here.
    from marl.testing.check_env import main as check_env
    from servers.episodes.view import recorded_samples

    sys.exit(check_env(args, recorded_samples))


def _add_check_env(sub: argparse._SubParsersAction) -> None:
    check = sub.add_parser("check-env", help="play a new env end to end through a tiny trainable server: a verdict",
                           description="PettingZoo's api_test on the env, then a few games with every role played"
                                       " through a real swarm server on a tiny random model (built offline), as"
                                       " `marl run` plays them, and one training step; checks that every role's"
                                       " episodes were recorded and merged with the env's rewards. Exit 0 OK, 1"
                                       " FAILED, 2 usage error (docs/envs.md).")
    check.add_argument("target", metavar="MODULE:CLASS", help="the env: module:Class or module:factory, or a game of"
                                                             " a suite: textarena:KuhnPoker-v0, openspiel:kuhn_poker")
    check.add_argument("--args", nargs="+", default=[], metavar="KEY=VALUE",
                       help="the env's arguments: key=value words (values read as YAML) or one JSON object")
    check.add_argument("--games", type=int, default=4, help="games to play (default 4; in pairs of one deal)")
    check.add_argument("--model", help="a model dir or alias to play with instead of the tiny random model")
    check.add_argument("--max-tokens", type=int, default=32, help="longest reply per turn (default 32)")
    check.add_argument("--run-dir", help="keep the server's data dir and log, games.jsonl and topology.yaml here")
    check.set_defaults(func=_check_env, trailing="args")


def _games(args: argparse.Namespace) -> None:
    from marl.games.view import list_games, show_game

    if args.games_command == "list":  # a GamesViewError (no games there, no such row): main()
        list_games(Path(args.run_dir), limit=args.limit)
    else:
        show_game(Path(args.run_dir), args.game)


def _add_serve(sub: argparse._SubParsersAction) -> None:

    serve = sub.add_parser("serve", help="run a swarm server for one model",
                           description="Serve one model: leases, an OpenAI-compatible endpoint, and (unless --static)"
                                       " GRPO training on the episodes its clients report.")
    serve.add_argument("--model", required=True, help="a Hugging Face id (org/name: from the Hugging Face cache, or"
                       " downloaded there; HF_HUB_OFFLINE, HF_TOKEN apply), a Hugging Face model directory, or an"
                       " alias: smollm2-135m")
    serve.add_argument("--revision", help="with a Hugging Face id: the branch, tag or commit to load (default: main)")
    serve.add_argument("--port", type=int, default=10086)
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 to accept remote clients)")
    serve.add_argument("--admin-token", help="token for control calls (default: $MARL_ADMIN_TOKEN, else generated)")
    serve.add_argument("--data-dir", help="ledger and checkpoints (default: runs/servers/<model>-<port>)")
    serve.add_argument("--static", action="store_true", help="serve the model only: no leases, no training")
    serve.add_argument("--served-model-name", help="model id clients send (default: the --model value; of a directory,"
                       " its last component)")
    serve.add_argument("--public-url", help="base URL handed to agents (default: the URL the client used)")
    serve.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    serve.add_argument("--prefix-cache-gb", type=_gigabytes,
                       help="memory for the keys/values of finished calls, reused by the next turn of the same"
                            " conversation instead of prefilling it again (default: 2; 0 turns it off)")
    serve.add_argument("--engine", choices=["torch", "vllm", "simulated"], default="torch",
                       help="torch: transformers in this process; vllm: vLLM in a subprocess of its own virtualenv"
                            " (`make vllm` builds .venv-vllm; or point $MARL_VLLM_PYTHON at one); simulated: no model,"
                            " the delays of vLLM serving a 7B on an H100 and a sleeping trainer, for benchmarks and"
                            " tests of the control plane only (the model is read for its tokenizer)")
    serve.add_argument("--simulated-speed", type=float, default=1.0, metavar="FACTOR",
                       help="with --engine simulated: run its delays FACTOR times faster than real time (default: 1)")
    _add_vllm_flags(serve)
    _add_placement_flags(serve)
    serve.add_argument("--policy", action="append", default=[], metavar="NAME[=LORA]",
                       help="train a LoRA policy of the model, each its own learner; repeat it for several. LORA: a"
                            ' JSON object of rank, alpha, dropout, target_modules, e.g. \'speaker={"rank": 16}\''
                            " (default: rank 16, alpha 32, every linear layer)")
    serve.add_argument("--adapter", metavar="DIR",
                       help="with --static: serve the model with this LoRA adapter (a PEFT directory, e.g. a policy"
                            " checkpoint's adapter/) applied to every call")
    serve.add_argument("--max-body-mb", type=_megabytes, default=16.0,
                       help="largest request body accepted, in MB (413 beyond; default: 16)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=_serve)


def _add_vllm_flags(serve: argparse.ArgumentParser) -> None:
    from marl.protocol import VLLM_WEIGHT_SYNC_MODES

    vllm = serve.add_argument_group("vLLM (with --engine vllm)", "How vLLM runs; a topology server's vllm: section"
                                    " sets the same keys (docs/backends.md). Left out: the device's defaults.")
    vllm.add_argument("--vllm-max-model-len", type=int, metavar="TOKENS",
                      help="longest prompt + completion (default: the model's context; a longer one is capped to it)")
    vllm.add_argument("--vllm-gpu-memory-utilization", type=float, metavar="FRACTION",
                      help="share of the GPU vLLM may take, in (0, 1]; vLLM refuses to start unless that much is free"
                           " (default on CUDA: 0.5 for a trainable server, whose trainer shares the GPU; 0.9 static)")
    vllm.add_argument("--vllm-kv-cache-gb", type=float, metavar="GB",
                      help="KV cache size, which wins over the utilization for it (default: 1 on the CPU; on CUDA,"
                           " what the utilization leaves)")
    vllm.add_argument("--vllm-tensor-parallel-size", type=int, metavar="N", help="GPUs per model replica (default 1)")
    vllm.add_argument("--vllm-data-parallel-size", type=int, metavar="N", help="model replicas (default 1)")
    vllm.add_argument("--vllm-dtype", metavar="DTYPE", help="auto, bfloat16, float16, half, float32 or float (default:"
                                                            " float32 on the CPU, bfloat16 on CUDA)")
    vllm.add_argument("--vllm-max-num-seqs", type=int, metavar="N", help="sequences run at once (default: vLLM's)")
    vllm.add_argument("--vllm-sleep-between-steps", choices=["auto", "true", "false"],
                      help="sleep mode (CUDA only): vLLM frees the GPU for each training step (default auto: on CUDA"
                           " for a trainable server)")
    vllm.add_argument("--vllm-weight-sync", choices=VLLM_WEIGHT_SYNC_MODES,
                      help="how the trainer's weights reach vLLM: disk, or vLLM's weight-transfer engine over ipc (vLLM"
                           " on the trainer's GPU) or nccl (GPUs of its own), the disk as the fallback (default auto:"
                           " disk on the CPU, by placement on CUDA; the CUDA paths have not run on a GPU yet)")
    vllm.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                      help="one more argument for vLLM's command line, as is; repeat it. Write --vllm-arg=--flag"
                           " (with '=') for an argument that starts with '-'")


def _add_placement_flags(serve: argparse.ArgumentParser) -> None:
    gpus = serve.add_argument_group("Placement", "Which of the GPUs this server sees its engine and trainer ranks use,"
                                    " e.g. 0,1 or 0-7; a topology server's placement: sets them (docs/architecture.md,"
                                    " \"Placement\"). Left out: the engine on GPU 0, trainer rank r on GPU r.")
    gpus.add_argument("--engine-gpus", type=_gpu_list, metavar="GPUS",
                      help="the engine's GPUs (vLLM: tensor x data parallel size of them; torch: one)")
    gpus.add_argument("--trainer-gpus", type=_gpu_list, metavar="GPUS",
                      help="the trainer's GPUs on each node, one FSDP rank each (trainer grpo: one)")
    gpus.add_argument("--ray-group", metavar="NAME", help="the server's Ray placement group (marl run with run.ray"
                      " makes it): its FSDP ranks (bundles 1..N) and vLLM replicas after the first (the last bundles)"
                      " are Ray actors there, on the nodes Ray reserved")
    gpus.add_argument("--ray-address", metavar="ADDR", help="with --ray-group: the Ray cluster's GCS address"
                      " (default: the cluster of this node)")
    gpus.add_argument("--ray-ranks", action=argparse.BooleanOptionalAction, default=True,
                      help="with --ray-group: its bundles hold the trainer's FSDP ranks (--no-ray-ranks: only vLLM's"
                      " replicas; a trainer runs here, on the server's GPUs)")
    gpus.add_argument("--trainer-nodes", type=int, help=argparse.SUPPRESS)  # deprecated: Ray places the ranks
    gpus.add_argument("--rendezvous-port", type=int, help=argparse.SUPPRESS)  # deprecated: not used


def _add_trainer_node(sub: argparse._SubParsersAction) -> None:
    node = sub.add_parser("trainer-node", help="deprecated: ranks on other machines are Ray actors (docs/ray.md)",
                          description="Deprecated: a trainer's ranks on other machines are Ray actors in the"
                                      " server's placement group now (run.ray, docs/ray.md). Prints what to do.")
    for flag in ("--server", "--port", "--node-rank", "--admin-token"):  # the old flags, accepted for one release
        node.add_argument(flag, help=argparse.SUPPRESS)
    node.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    node.set_defaults(func=_trainer_node)


def _add_status(sub: argparse._SubParsersAction) -> None:
    status = sub.add_parser("status", help="print a server's status as JSON")
    status.add_argument("url", type=_swarm_url, help="the server's URL, e.g. http://127.0.0.1:10086")
    status.add_argument("--admin-token", help="default: $MARL_ADMIN_TOKEN")
    status.add_argument("--timeout", type=_seconds, default=5.0, metavar="SECONDS",
                        help="give up on a server that does not answer after this long (default: 5)")
    status.set_defaults(func=_status)


def _add_topology(sub: argparse._SubParsersAction) -> None:
    topology = sub.add_parser("topology", help="inspect a topology file",
                              description="Topologies say which model server plays each role (topologies/*.yaml).")
    topology_sub = topology.add_subparsers(dest="topology_command", required=True)
    show = topology_sub.add_parser("show", help="validate a topology and print its servers, roles, teams, env, run",
                                   description="Load and validate a topology (with key=value overrides, as `marl run`"
                                               " takes them) and print it; exits 2 with every problem found.")
    show.add_argument("file", help="topology YAML, e.g. topologies/signalling-cpu.yaml")
    show.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, e.g. run.max_steps=5")
    show.add_argument("--no-env-check", action="store_true",
                      help="do not import and construct env.class, nor check roles: against the roles it deals,"
                           " nor that the local servers' models are on this machine (a topology for another one)")
    show.set_defaults(func=_topology_show, trailing="overrides")


def _plan(args: argparse.Namespace) -> None:
    from marl.plan import plan_topology
    from marl.plan.report import plan_console, print_plan
    from marl.topology import Topology

    topology = Topology.load(args.file, args.overrides, check_env=False)  # TopologyError: main()
    plan = plan_topology(topology.spec)
    print_plan(plan, plan_console())
    sys.exit(1 if plan.problems else 0)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="will the topology's models fit their devices? memory per GPU, disk per step",
                          description="For every local server, and every remote one whose placement: states its"
                                      " GPUs, the memory of each device at rollouts and during a training step"
                                      " (engine weights, KV cache, CUDA graphs; trainer shards, activations,"
                                      " logits), and the disk written per step and per checkpoint. Exits 1, naming"
                                      " the key to change, when something does not fit; `marl run` makes the same"
                                      " check before it starts anything. docs/design.md, \"Memory plan\".")
    plan.add_argument("file", help="topology YAML, e.g. topologies/werewolves-7b-14b-235b.yaml")
    plan.add_argument("overrides", nargs="*", metavar="key=value",
                      help="overrides, e.g. servers.a.vllm.max_model_len=8192")
    plan.set_defaults(func=_plan, trailing="overrides")


def _add_run(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="play and train a topology: start local servers, play games, train each model",
                         description="Start the topology's local servers (logs in the run directory), connect to its"
                                     " remote ones, sync configs, start engines, and play games until run.games or"
                                     " run.max_steps. Ctrl-C aborts open leases and stops what it started.")
    run.add_argument("file", help="topology YAML, e.g. topologies/signalling-cpu.yaml")
    run.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, e.g. run.max_steps=5")
    run.set_defaults(func=_run, trailing="overrides")


def _add_overwatch(sub: argparse._SubParsersAction) -> None:
    overwatch = sub.add_parser("overwatch", help="live terminal monitor of one or many swarm servers",
                               description="Watch servers side by side, refreshed every second: state, policy"
                                           " version, pool progress, leases, reward per role, tokens/s, errors."
                                           " Keys: 1-9 one server, a all, tab/left/right move, q quit.")
    overwatch.add_argument("targets", nargs="+", metavar="URL|TOPOLOGY",
                           help="server URLs, or one topology YAML (its local servers while `marl run` runs) and the"
                                " overrides `marl run` was given, e.g. run.run_dir=runs/x")
    overwatch.add_argument("--admin-token", help="default: $MARL_ADMIN_TOKEN (a topology run's own token is read"
                                                 " from its run dir)")
    overwatch.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    overwatch.add_argument("--once", action="store_true", help="print one snapshot and exit (no UI)")
    overwatch.set_defaults(func=_overwatch, trailing="targets")


def _add_plot(sub: argparse._SubParsersAction) -> None:
    plot = sub.add_parser("plot", help="write PNG reward/loss curves of a run directory",
                          description="From games.jsonl and servers/*/metrics.jsonl: reward_curves.png and"
                                      " servers/<name>/training.png. Prints the paths written.")
    plot.add_argument("run_dir", help="a run directory (runs/<name>) or one server's data dir")
    plot.set_defaults(func=_plot)


def _add_episode(sub: argparse._SubParsersAction) -> None:
    episode = sub.add_parser("episode", help="inspect the episodes in a server's ledger")
    episode_sub = episode.add_subparsers(dest="episode_command", required=True)
    listing = episode_sub.add_parser("list", help="the latest episodes, newest first")
    listing.add_argument("data_dir", help="a server's data dir (holds ledger.sqlite)")
    listing.add_argument("--limit", type=int, default=20)
    listing.set_defaults(func=_episode)
    show_ep = episode_sub.add_parser("show", help="one episode's samples, token by token, with loss masks",
                                     description="Tokens the model is trained on are wrapped in [[...]] (coloured"
                                                 " by logprob in a terminal); context tokens are left bare.")
    show_ep.add_argument("data_dir", help="a server's data dir (holds ledger.sqlite)")
    show_ep.add_argument("episode_id", nargs="?", help="an episode id or a unique prefix (default: the latest)")
    show_ep.add_argument("--model", help="tokenizer to decode with (default: newest checkpoint, else the served model)")
    show_ep.add_argument("--tokens", action="store_true", help="also one row per token: mask, logprob, token")
    show_ep.set_defaults(func=_episode)


def _add_games(sub: argparse._SubParsersAction) -> None:
    games = sub.add_parser("games", help="read a run's games (games.jsonl): one game turn by turn, or a list",
                           description="What each game of a run was: task, players, rewards, the env's summary and,"
                                       " as run.transcripts kept it, who said what turn by turn.")
    games_sub = games.add_subparsers(dest="games_command", required=True)
    show = games_sub.add_parser("show", help="one game: header, the env's summary, turn by turn who said what")
    show.add_argument("run_dir", help="a run directory (runs/<name>) or a games.jsonl")
    show.add_argument("game", nargs="?", help="a row number (0 is the first, -1 the latest) or a task id (its latest"
                                              " game); default: the latest game")
    show.set_defaults(func=_games)
    listing = games_sub.add_parser("list", help="the latest games, one line each, with their row numbers")
    listing.add_argument("run_dir", help="a run directory (runs/<name>) or a games.jsonl")
    listing.add_argument("--limit", type=int, default=20)
    listing.set_defaults(func=_games)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marl", description="Multi-agent RL for heterogeneous teams of LLM agents.")
    sub = parser.add_subparsers(dest="command", required=True)
    from marl.eval.command import add_eval_parser
    from marl.proxy import add_proxy_parser

    for add in (_add_serve, _add_trainer_node, _add_status, _add_topology, _add_plan, _add_run, _add_overwatch,
                _add_plot, _add_games, _add_episode, _add_check_env, add_eval_parser, add_proxy_parser):
        add(sub)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line. `key=value` arguments may also follow options (`marl eval F --games 8 listener=5`):
    argparse stops filling a trailing positional list at the first option, so the rest join that list here."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    trailing = getattr(args, "trailing", None)
    if extra and (trailing is None or any(arg.startswith("-") or "=" not in arg for arg in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        getattr(args, trailing).extend(extra)
    return args


#: marl's exceptions for a mistake in what was asked, by module: a topology, a checkpoint, an overwatch target, a run's
#: games or a server's ledger that is not there, a server that refuses or cannot be reached (the whole `SwarmError`
#: tree). Each message says what to do. Named, not imported: a class whose module was never imported was not raised.
_USER_ERRORS = (("marl.client.errors", "SwarmError"), ("marl.topology.problems", "TopologyError"),
                ("marl.league.snapshots", "SnapshotError"), ("marl.watching.overwatch", "OverwatchError"),
                ("marl.games.view", "GamesViewError"), ("servers.episodes.view", "ViewerError"))


def _user_error(exc: BaseException) -> bool:
    return any(isinstance(exc, getattr(sys.modules[module], name)) for module, name in _USER_ERRORS
               if module in sys.modules)


def _fail(args: argparse.Namespace, message: object) -> NoReturn:
    """argparse's way: `marl <command>: error: <message>` on stderr, exit 2."""
    command = [args.command, getattr(args, f"{args.command}_command", None)]  # e.g. `marl games show`
    print(f"marl {' '.join(filter(None, command))}: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    """Run one command. A mistake in what was asked (`_USER_ERRORS`) is one line and exit 2, as argparse answers a
    bad argument; any other exception is a bug and keeps its traceback."""
    args = parse(argv)
    try:
        args.func(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        if not _user_error(exc):
            raise
        _fail(args, exc)


if __name__ == "__main__":
    main()
