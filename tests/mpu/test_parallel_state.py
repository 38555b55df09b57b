"""Group layout: Megatron's rank order, asserted rank by rank; every group's collective timeout."""

import ast
import contextlib
import datetime
import pathlib

import pytest
import torch.distributed as dist

from megazero import mpu
from megazero.mpu.parallel_state import collective_timeout, group_ranks
from tests.distributed import run_distributed


def test_worked_example_16_ranks_tp2_pp4():
    # The example in parallel_state's docstring, exactly.
    g = group_ranks(16, tp=2, pp=4)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g["mp"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]


def test_world_not_divisible_is_refused_with_numbers():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible .*\(4\) x .*\(1\) = 4"):
        group_ranks(6, tp=4, pp=1)


def _layout_8_ranks():
    groups = mpu.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    # The registry and the returned object agree, and a second init is refused.
    assert mpu.get_parallel_groups() is groups
    try:
        mpu.initialize_model_parallel(2, 2)
        raise AssertionError("second initialize_model_parallel was accepted")
    except RuntimeError:
        pass
    # The groups really connect the listed ranks: sum the global ranks over each one.
    sums = {}
    for kind, group in [("tp", mpu.get_tensor_model_parallel_group()), ("dp", mpu.get_data_parallel_group()),
                        ("pp", mpu.get_pipeline_model_parallel_group()), ("mp", mpu.get_model_parallel_group())]:
        import torch
        t = torch.tensor([dist.get_rank()])
        dist.all_reduce(t, group=group)
        sums[kind] = int(t)
    return dict(
        tp=(mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size(), groups.tp_ranks),
        dp=(mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(), groups.dp_ranks),
        pp=(mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size(), groups.pp_ranks),
        mp=(mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(), groups.mp_ranks),
        src=mpu.get_tensor_model_parallel_src_rank(),
        dp_src=mpu.get_data_parallel_src_rank(),
        first=mpu.is_pipeline_first_stage(), last=mpu.is_pipeline_last_stage(),
        sums=sums,
    )


def test_layout_8_ranks_tp2_pp2_rank_by_rank():
    results = run_distributed(8, _layout_8_ranks)
    # rank: (tp_rank, dp_rank, pp_rank, tp group, dp group, pp group, mp group)
    expected = {
        0: (0, 0, 0, (0, 1), (0, 2), (0, 4), (0, 1, 4, 5)),
        1: (1, 0, 0, (0, 1), (1, 3), (1, 5), (0, 1, 4, 5)),
        2: (0, 1, 0, (2, 3), (0, 2), (2, 6), (2, 3, 6, 7)),
        3: (1, 1, 0, (2, 3), (1, 3), (3, 7), (2, 3, 6, 7)),
        4: (0, 0, 1, (4, 5), (4, 6), (0, 4), (0, 1, 4, 5)),
        5: (1, 0, 1, (4, 5), (5, 7), (1, 5), (0, 1, 4, 5)),
        6: (0, 1, 1, (6, 7), (4, 6), (2, 6), (2, 3, 6, 7)),
        7: (1, 1, 1, (6, 7), (5, 7), (3, 7), (2, 3, 6, 7)),
    }
    for rank, r in enumerate(results):
        tp_rank, dp_rank, pp_rank, tp_g, dp_g, pp_g, mp_g = expected[rank]
        assert r["tp"] == (tp_rank, 2, tp_g), rank
        assert r["dp"] == (dp_rank, 2, dp_g), rank
        assert r["pp"] == (pp_rank, 2, pp_g), rank
        assert r["mp"] == (pp_rank * 2 + tp_rank, 4, mp_g), rank
        assert r["src"] == tp_g[0] and r["dp_src"] == dp_g[0]
        assert r["first"] == (pp_rank == 0) and r["last"] == (pp_rank == 1)
        assert r["sums"] == {"tp": sum(tp_g), "dp": sum(dp_g), "pp": sum(pp_g), "mp": sum(mp_g)}, rank


def test_uninitialized_getters_mean_single_process():
    assert not mpu.model_parallel_is_initialized()
    assert mpu.get_tensor_model_parallel_world_size() == 1
    assert mpu.get_data_parallel_rank() == 0
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        mpu.get_tensor_model_parallel_group()


def test_deepspeed_mpu_contract():
    # deepspeed.initialize(mpu=...) calls exactly these names.
    for name in ["get_model_parallel_rank", "get_model_parallel_group", "get_model_parallel_world_size",
                 "get_data_parallel_rank", "get_data_parallel_group", "get_data_parallel_world_size",
                 "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size",
                 "get_tensor_model_parallel_group", "get_pipeline_model_parallel_rank",
                 "get_pipeline_model_parallel_world_size", "get_pipeline_model_parallel_group"]:
        assert callable(getattr(mpu, name)), name


# ---- pipeline groups: embedding (first + last stage), position embedding, virtual stages -----------

def test_embedding_groups_pure_layout():
    g = group_ranks(16, tp=2, pp=4)
    assert g["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert g["position_embedding"] == [[0], [1], [2], [3]]
    # Without a pipeline every rank is its own first and last stage.
    assert group_ranks(4, tp=2, pp=1)["embedding"] == [[0], [1], [2], [3]]


def _pipeline_layout(tp, pp, vpp):
    groups = mpu.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp)
    import torch
    sums = {}
    for kind, group in [("emb", groups.embedding_group), ("pos", groups.position_embedding_group)]:
        if group is None:
            sums[kind] = None
            continue
        t = torch.tensor([dist.get_rank()])
        dist.all_reduce(t, group=group)
        sums[kind] = int(t)
    return dict(emb=groups.embedding_ranks, pos=groups.position_embedding_ranks, sums=sums,
                in_emb=mpu.is_rank_in_embedding_group(), in_pos=mpu.is_rank_in_position_embedding_group(),
                vpp=mpu.get_virtual_pipeline_model_parallel_world_size(),
                first=[mpu.is_pipeline_first_stage(ignore_virtual=False, virtual_rank=c) for c in range(vpp or 1)],
                last=[mpu.is_pipeline_last_stage(ignore_virtual=False, virtual_rank=c) for c in range(vpp or 1)],
                first_any=mpu.is_pipeline_first_stage(), last_any=mpu.is_pipeline_last_stage())


def test_embedding_groups_8_ranks_tp2_pp2_dp2():
    results = run_distributed(8, _pipeline_layout, 2, 2, None)
    for rank, r in enumerate(results):
        pp_rank = rank // 4
        # Pipelines are [0,4] [1,5] [2,6] [3,7]: both ends of each hold the embedding.
        assert r["emb"] == (rank % 4, rank % 4 + 4) and r["sums"]["emb"] == 2 * (rank % 4) + 4, rank
        assert r["in_emb"]
        assert r["pos"] == ((rank,) if pp_rank == 0 else ()) and r["in_pos"] == (pp_rank == 0), rank
        assert r["vpp"] == 1 and r["first"] == [pp_rank == 0] and r["last"] == [pp_rank == 1]


def test_embedding_groups_pp4_with_virtual_stages():
    results = run_distributed(4, _pipeline_layout, 1, 4, 2)
    for rank, r in enumerate(results):
        end = rank in (0, 3)
        assert r["emb"] == ((0, 3) if end else ()) and r["in_emb"] == end, rank
        assert r["sums"]["emb"] == (3 if end else None)
        assert r["sums"]["pos"] == (0 if rank == 0 else None)
        assert r["vpp"] == 2
        # Chunk 0 of rank 0 is the first virtual stage; chunk 1 of rank 3 the last.
        assert r["first"] == [rank == 0, False] and r["last"] == [False, rank == 3], rank
        assert r["first_any"] == (rank == 0) and r["last_any"] == (rank == 3)


def _bad_virtual():
    try:
        mpu.initialize_model_parallel(1, 1, virtual_pipeline_model_parallel_size=2)
    except ValueError as e:
        return str(e)
    return None


def test_virtual_stages_without_pipeline_refused():
    msg = run_distributed(2, _bad_virtual)[0]
    assert msg is not None and "needs pipeline_model_parallel_size > 1" in msg


# Neither torch's gloo default (30 min) nor its NCCL one (10 min), nor the test pool's.
_TIMEOUT = datetime.timedelta(seconds=417)
_GROUP_FIELDS = ("tp_group", "pp_group", "dp_group", "mp_group", "embedding_group", "position_embedding_group")


@contextlib.contextmanager
def _default_group_timeout(timeout):
    before = collective_timeout()
    dist.distributed_c10d._set_pg_timeout(timeout)  # the default group
    try:
        yield
    finally:
        dist.distributed_c10d._set_pg_timeout(before)


def _new_group_calls():
    """Every ``dist.new_group`` call of model-parallel initialization (tp 2 x pp 2, then tp 2 x
    dp 2) and of a ZeRO-3 engine's construction, with the timeout each was given."""
    from megazero import zero
    from megazero.model import GPTModel
    from megazero.zero import comm
    from tests.zero.common import GLOBAL_MICRO_ROWS, ds_config, tiny_config

    calls = []
    real_new_group, real_desc = dist.new_group, comm._GRADS_DESC
    # A description no earlier engine used, so this engine asks for its own gradient communicator
    # (engines otherwise reuse one per set of ranks); it is handed the DP group itself, so no
    # group outlives the test.
    comm._GRADS_DESC = "megazero_zero3_grads_timeout_check"

    def recording(ranks=None, **kwargs):
        calls.append((list(ranks), kwargs.get("timeout"), kwargs.get("group_desc")))
        if kwargs.get("group_desc") == comm._GRADS_DESC:
            return mpu.get_data_parallel_group()
        return real_new_group(ranks, **kwargs)

    dist.new_group = recording
    try:
        with _default_group_timeout(_TIMEOUT):
            mpu.initialize_model_parallel(2, 2)
            mpu.destroy_model_parallel()
            mpu.initialize_model_parallel(2, 1)
            engine = zero.initialize(GPTModel(tiny_config(), device="meta"),
                                     ds_config(3, micro=GLOBAL_MICRO_ROWS // 2), mpu=mpu)
            assert engine.comm.groups["dp_grads"] is mpu.get_data_parallel_group()
    finally:
        dist.new_group, comm._GRADS_DESC = real_new_group, real_desc
    return [(ranks, None if t is None else t.total_seconds(), desc) for ranks, t, desc in calls]


def test_every_group_is_created_with_the_default_groups_timeout():
    for rank, calls in enumerate(run_distributed(4, _new_group_calls)):
        # Every group of both layouts (each rank creates every group), then the engine's gradient
        # communicator.
        layouts = [line for tp, pp in [(2, 2), (2, 1)] for lines in group_ranks(4, tp, pp).values() for line in lines]
        assert [ranks for ranks, _, _ in calls[:-1]] == layouts, (rank, calls)
        assert calls[-1][2] == "megazero_zero3_grads_timeout_check"
        assert calls[-1][0] == [rank % 2, rank % 2 + 2]
        assert all(t == _TIMEOUT.total_seconds() for _, t, _ in calls), (rank, calls)


def _effective_timeouts():
    with _default_group_timeout(_TIMEOUT):
        groups = mpu.initialize_model_parallel(2, 2)
        out = {f: collective_timeout(getattr(groups, f)) for f in _GROUP_FIELDS if getattr(groups, f) is not None}
        out["default"] = collective_timeout()
        # An explicit timeout is kept.
        out["explicit"] = collective_timeout(mpu.parallel_state.new_group([0, 1, 2, 3], timeout=datetime.timedelta(seconds=61)))
    return out


def test_group_timeout_is_the_default_groups():
    for rank, timeouts in enumerate(run_distributed(4, _effective_timeouts)):
        explicit = timeouts.pop("explicit")
        assert explicit == datetime.timedelta(seconds=61)
        assert set(timeouts) >= {"default", "tp_group", "pp_group", "dp_group", "mp_group"}, timeouts
        assert all(t == _TIMEOUT for t in timeouts.values()), (rank, timeouts)


def test_no_group_is_created_around_the_helper():
    """megazero creates process groups only through ``parallel_state.new_group``, which adds the timeout."""
    creators = {"new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group"}
    root = pathlib.Path(mpu.__file__).resolve().parents[1]
    direct = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in creators:
                direct.append((path.relative_to(root.parent).as_posix(), ast.unparse(node.func)))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
                direct += [(path.relative_to(root.parent).as_posix(), f"import {a.name}")
                           for a in node.names if a.name in creators]
    assert direct == [("megazero/mpu/parallel_state.py", "dist.new_group")], direct


def test_context_parallel_layout_follows_megatron_order():
    # tp 2 x cp 2 x dp 2 x pp 2 on 16 ranks: tp fastest, then cp, then dp, then pp.
    g = group_ranks(16, tp=2, pp=2, cp=2)
    assert g["tp"][:2] == [[0, 1], [2, 3]]
    assert g["cp"][:2] == [[0, 2], [1, 3]]
    assert g["dp"][:2] == [[0, 4], [1, 5]]
    assert g["dp_cp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["pp"][0] == [0, 8]
    assert g["mp"][0] == [0, 1, 8, 9]  # tensor x pipeline for each data and context rank
    for kind in ("tp", "cp", "dp", "pp"):  # each kind partitions the world
        assert sorted(r for line in g[kind] for r in line) == list(range(16)), kind
    assert "cp" not in group_ranks(16, tp=2, pp=2)  # cp 1: the layout of before, no extra groups
    assert group_ranks(16, tp=2, pp=2)["dp"][0] == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="context_parallel_size"):
        group_ranks(12, tp=2, pp=2, cp=2)


def _cp_groups():
    from megazero import mpu as m

    groups = m.initialize_model_parallel(2, context_parallel_size=2)
    return (groups.cp_size, groups.cp_rank, groups.cp_ranks, groups.dp_cp_ranks, groups.dp_ranks,
            m.get_data_parallel_world_size(with_context_parallel=True), m.get_context_parallel_world_size())


def test_context_parallel_groups_on_eight_ranks():
    from tests.distributed import run_distributed

    for rank, (cp, cp_rank, cp_ranks, dp_cp_ranks, dp_ranks, dp_cp_size, cp_size) in enumerate(
            run_distributed(8, _cp_groups)):
        assert (cp, cp_size, dp_cp_size) == (2, 2, 4)
        assert cp_rank == (rank // 2) % 2 and rank in cp_ranks and len(cp_ranks) == 2
        assert set(dp_ranks) < set(dp_cp_ranks) and len(dp_cp_ranks) == 4


def test_expert_layout_follows_megatron_core_order():
    """The ranks of a pipeline stage laid out again as etp x ep x expert-dp, etp fastest; etp = tp keeps the
    layout where ep runs over data x context at each TP rank."""
    g = group_ranks(16, tp=2, pp=2, ep=2, etp=1)  # a stage: 8 ranks = tp 2 x dp 4 -> ep 2 x edp 4
    assert g["ep"][:2] == [[0, 1], [2, 3]] and g["etp"][0] == [0]
    assert g["edp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]] and g["edp"][2] == [8, 10, 12, 14]
    g = group_ranks(16, tp=2, pp=1, ep=2, etp=4)  # 16 ranks = etp 4 x ep 2 x edp 2
    assert g["etp"][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["ep"][:2] == [[0, 4], [1, 5]] and g["expert"][0] == list(range(8))
    assert g["edp"][0] == [0, 8]
    same = group_ranks(16, tp=2, pp=2, ep=2)  # etp = tp: the etp groups are the TP groups
    assert same["etp"] == same["tp"] and same["ep"][:2] == [[0, 2], [1, 3]] and same["edp"][0] == [0, 4]
    with pytest.raises(ValueError, match="must divide the 8 ranks of a pipeline stage"):
        group_ranks(16, tp=2, pp=2, ep=4, etp=4)


def _expert_groups(tp: int, ep: int, etp: int):
    from megazero import mpu as m

    g = m.initialize_model_parallel(tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    return (m.get_expert_tensor_parallel_world_size(), m.get_expert_tensor_parallel_rank(),
            m.get_expert_model_parallel_rank(), g.edp_ranks, g.expert_ranks,
            g.etp_group is g.tp_group, g.expert_group is not None)


def test_expert_tensor_parallel_groups_on_four_ranks():
    from tests.distributed import run_distributed

    # tp 2, whole experts: ep 2 over each TP pair, expert-DP over the pairs; no etp group (size 1)
    for rank, (etp, etp_rank, ep_rank, edp, expert, is_tp, _) in enumerate(run_distributed(4, _expert_groups, 2, 2, 1)):
        assert (etp, etp_rank, ep_rank) == (1, 0, rank % 2)
        assert edp == (rank % 2, rank % 2 + 2) and expert == (rank - rank % 2, rank - rank % 2 + 1)
    # tp 1, experts sharded over pairs: etp x ep = all 4, expert-DP 1
    for rank, (etp, etp_rank, ep_rank, edp, expert, _, built) in enumerate(run_distributed(4, _expert_groups, 1, 2, 2)):
        assert (etp, etp_rank, ep_rank, edp, expert, built) == (2, rank % 2, rank // 2, (rank,), (0, 1, 2, 3), True)
    # etp = tp: the TP group itself
    assert all(r[5] and r[0] == 2 for r in run_distributed(4, _expert_groups, 2, 2, 2))
