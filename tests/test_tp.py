"""TP-aware profiles on simulated ranks: shards, per-rank grouping, and schedulers that agree."""

from __future__ import annotations

import pytest

from tangram_sgl.profile import ModelIdentity, ProfileError, profile_from_dict
from tangram_sgl.profile_builder import build_profile
from tangram_sgl.tp import agreed_segment_pages, rank_profile, segment_pages, shard_kv_heads

CONFIG = {"model_type": "llama", "num_hidden_layers": 3, "num_attention_heads": 32, "num_key_value_heads": 8,
          "hidden_size": 512, "intermediate_size": 1024, "vocab_size": 100}


def _profile(grouping: str = "cross_layer"):
    model = ModelIdentity.from_config(CONFIG)
    # Rank 0's heads (0..3) need much more than rank 1's (4..7): shards are unbalanced on purpose.
    mean = [[0.9, 0.7, 0.6, 0.5, 0.1, 0.05, 0.1, 0.2] for _ in range(3)]
    std = [[0.02 * (h + 1) for h in range(8)] for _ in range(3)]
    return build_profile(model, mean, std, scorer="snapkv", target_ratio=0.3, grouping=grouping)


def test_shards_follow_sglang_split():
    assert shard_kv_heads(8, 2, 1) == (4, 5, 6, 7)
    assert shard_kv_heads(8, 16, 3) == (1,)  # replication when tp > kv heads
    with pytest.raises(ProfileError, match="3 kv heads cannot be split over tp_size 2"):
        shard_kv_heads(3, 2, 0)


@pytest.mark.parametrize("grouping", ["per_layer", "cross_layer"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_rank_profiles_partition_heads_and_stay_valid(grouping, tp):
    prof = _profile(grouping)
    seen = set()
    for r in range(tp):
        rp = rank_profile(prof, tp, r)
        profile_from_dict(rp.to_dict())  # a rank's profile is itself a valid profile
        heads = rp.notes["tp"]["global_kv_heads"]
        assert rp.model.num_kv_heads == len(heads) == 8 // tp
        for li in range(3):
            assert rp.budget[li] == tuple(prof.budget[li][h] for h in heads)
        local = sorted(m for g in rp.groups for m in g.members)
        assert local == [(li, h) for li in range(3) for h in range(len(heads))]
        seen |= {(li, h) for li in range(3) for h in heads}
    assert len(seen) == 24


def test_tp1_matches_the_whole_model():
    prof = _profile()
    assert segment_pages(rank_profile(prof, 1, 0), 5000, 0) == segment_pages(prof, 5000, 0)


def test_schedulers_on_all_ranks_agree():
    """Admission with a fixed page budget per rank: own-shard demand diverges, agreed demand does not."""
    prof = _profile()
    tp, capacity = 2, 2000
    segments = [(n, start) for n, start in [(3000, 0), (800, 3000), (5000, 0), (1200, 5000), (7000, 0)]]

    def admitted(demand) -> list[bool]:
        used, out = 0, []
        for n, start in segments:
            need = demand(n, start)
            out.append(used + need <= capacity)
            used += need if out[-1] else 0
        return out

    own = [admitted(lambda n, s, r=r: segment_pages(rank_profile(prof, tp, r), n, s)) for r in range(tp)]
    agreed = [admitted(lambda n, s: agreed_segment_pages(prof, tp, n, s)) for _ in range(tp)]
    assert own[0] != own[1], "the unbalanced shards should make per-rank decisions differ"
    assert agreed[0] == agreed[1]
    for n, s in segments:
        assert agreed_segment_pages(prof, tp, n, s) == max(
            segment_pages(rank_profile(prof, tp, r), n, s) for r in range(tp))
