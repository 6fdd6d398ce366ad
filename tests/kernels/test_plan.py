"""The decode heuristic (CPU): single pass when the CTAs fill the chip or contexts are
short, split-K otherwise, in the longest partitions that fill it; GQA groups map onto CTAs of at most 8 query
heads (16 on tensor cores)."""

from __future__ import annotations

import pytest

from cupy_kernels.ops import PARTITION_CHOICES, plan_decode

SMS = 132  # H100 SXM / H200


@pytest.mark.parametrize("group, heads_per_cta, num_chunks", [(1, 1, 1), (3, 4, 1), (4, 4, 1), (8, 8, 1),
                                                              (12, 8, 2), (16, 8, 2)])
def test_group_tiling(group, heads_per_cta, num_chunks):
    plan = plan_decode(64, 8, group, 4096, SMS)
    assert (plan.heads_per_cta, plan.num_chunks) == (heads_per_cta, num_chunks)


def test_split_for_small_batches_with_long_contexts():
    # 8 CTAs: 1024- and 512-token partitions give 64 and 128, short of 132 SMs; 256 gives 256.
    plan = plan_decode(1, 8, 8, 8192, SMS)
    assert plan.split and (plan.partition_tokens, plan.num_partitions) == (256, 32)
    plan = plan_decode(16, 4, 8, 4096, SMS)  # 64 CTAs x 4 partitions of 1024
    assert (plan.partition_tokens, plan.num_partitions) == (1024, 4)
    plan = plan_decode(1, 4, 8, 1024, SMS)  # no choice fills the chip: the shortest
    assert (plan.partition_tokens, plan.num_partitions) == (PARTITION_CHOICES[-1], 8)


def test_single_pass_when_ctas_fill_the_chip_or_contexts_are_short():
    assert not plan_decode(64, 32, 1, 8192, SMS).split  # 2048 CTAs
    assert not plan_decode(64, 4, 8, 8192, SMS).split  # 256 CTAs
    assert not plan_decode(1, 8, 8, PARTITION_CHOICES[-1], SMS).split
    assert plan_decode(1, 8, 8, PARTITION_CHOICES[-1] + 1, SMS).num_partitions == 2
    assert plan_decode(4, 8, 8, 8192, SMS).split  # 32 CTAs alone would leave 100 SMs idle


@pytest.mark.parametrize("group, num_chunks", [(1, 1), (7, 1), (16, 1), (20, 2)])
def test_tensor_core_plans_take_16_heads_per_cta(group, num_chunks):
    plan = plan_decode(64, 8, group, 4096, SMS, tensor_cores=True)
    assert plan.tensor_cores and (plan.heads_per_cta, plan.num_chunks) == (16, num_chunks)
    split = plan_decode(8, 2, 16, 8192, SMS, tensor_cores=True)  # 16 CTAs: split-K, on tensor cores still
    assert split.split and split.tensor_cores
