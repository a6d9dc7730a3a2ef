"""SwarmClient against a real server: AgentJet's call style, idempotent start, waiting through a weight sync."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ADMIN

from marl import EpisodeOutput, ErrorCode, SwarmClient, SwarmRefused


def test_seed_style_episode_lifecycle(local_server):
    with local_server() as srv, SwarmClient(srv.url, admin_token=ADMIN) as client:
        config = {"batch_size": 100, "num_repeat": 2, "learning_rate": 1e-5}  # AgentJet's flat dict
        assert client.auto_sync_train_config_and_start_engine(config).state.value == "ROLLING"
        generation = client.status().generation
        client.auto_sync_train_config_and_start_engine(config)  # already ROLLING with this config: no restart
        nested = {"batch_size": 100, "num_repeat": 2, "grpo": {"learning_rate": 1e-5}}
        client.auto_sync_train_config_and_start_engine(nested)  # the same config, spelled the new way
        assert client.status().generation == generation

        episode_id, lease = client.begin_episode()
        oai = client.openai_client(lease, agent="solver")
        oai.chat.completions.create(model=lease.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert client.can_continue_episode(episode_id)
        result = client.end_episode("task-1", episode_id, EpisodeOutput(reward=1.0, metadata={"note": "ok"}),
                                    include_pool=True)
        assert result.samples == 1 and result.pool.pending_episodes == 1
        assert not client.can_continue_episode(episode_id)

        episode_id, _ = client.begin_episode()
        client.abort_episode(episode_id)
        assert not client.can_continue_episode(episode_id)

        other = SwarmClient(srv.url, admin_token=ADMIN)
        episode_id, _ = client.begin_episode()
        with pytest.raises(SwarmRefused) as refused:
            other.end_episode("task-1", episode_id, 1.0)
        assert refused.value.code is ErrorCode.NOT_LEASE_HOLDER
        other.close()
        with pytest.raises(SwarmRefused) as refused:
            client.auto_sync_train_config_and_start_engine({"batch_size": 3})  # running with another config
        assert refused.value.code is ErrorCode.ENGINE_NOT_OFFLINE


def test_begin_waits_through_rolling_post_and_weight_sync(local_server):
    with local_server() as srv, SwarmClient(srv.url, admin_token=ADMIN) as client:
        client.auto_sync_train_config_and_start_engine({"batch_size": 1, "num_repeat": 4, "save_freq": 0})

        def play(i: int) -> int:
            with client.episode("same-task") as ep:
                ep.openai().chat.completions.create(
                    model=ep.model, messages=[{"role": "user", "content": f"{i}"}], max_tokens=2)
                ep.reward = float(i % 2)
            return i

        # 12 episodes through a server that trains once 4 are in: later begins wait, none fails
        with ThreadPoolExecutor(6) as pool:
            assert sorted(pool.map(play, range(12))) == list(range(12))
        status = client.wait_until_state("ROLLING")
        assert status.policy_version >= 1  # (a step trains on every pooled episode of the group: 4 or more)
        assert status.metrics["episodes_ended"] == 12 and status.pool.running_leases == 0
