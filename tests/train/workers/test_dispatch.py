import ray
import torch

from skyrl.train.schema import TrainerConfig
from skyrl.train.training_batch import TrainingInputBatch, partition_rows
from skyrl.train.utils.data import split_train_data_by_dp
from skyrl.train.workers.dispatch import MeshDispatch
from skyrl.train.workers.fsdp_worker import PolicyWorker


def numbered_batch(n: int) -> TrainingInputBatch:
    """Row i holds the value i, and i + 1 tokens of attention (so balancing has work to do)."""
    attention = torch.zeros(n, n + 1, dtype=torch.long)
    for i in range(n):
        attention[i, : i + 1] = 1
    batch = TrainingInputBatch(
        {
            "row": torch.arange(n).float()[:, None],
            "sequences": torch.arange(n * (n + 1)).view(n, n + 1),
            "attention_mask": attention,
            "loss_mask": torch.ones(n, 1),
        }
    )
    batch.metadata["uids"] = [f"u{i}" for i in range(n)]
    return batch


def rank_outputs(staged, dp_size, balance, delay_split):
    """What each rank's forward would return: one output per row of its parts of every mini-batch, in
    order (here: the row's value times 10)."""
    outputs = []
    for rank in range(dp_size):
        per_mini = []
        for mini in staged:
            part = mini.fetch(rank)
            if delay_split:
                part = part.select_rows(partition_rows(part, dp_size, balance)[rank])
            per_mini.append(TrainingInputBatch({"out": part["row"] * 10}))
        outputs.append(TrainingInputBatch.cat(per_mini))
    return outputs


def test_stage_chunks_pads_each_mini_batch_to_the_dp_size(ray_cluster):
    batch = numbered_batch(10)
    staged = MeshDispatch.stage_chunks(4, batch, [(0, 3), (3, 8), (8, 10)])
    assert [len(m) for m in staged] == [4, 4, 4]
    parts = [[m.fetch(r) for r in range(4)] for m in staged]
    assert [[len(p) for p in mini] for mini in parts] == [[1, 1, 1, 1], [2, 2, 2, 2], [1, 1, 1, 1]]
    assert staged[1].rows == [[0, 4], [1, 5], [2, 6], [3, 7]]  # strided; rows >= 5 are the 3 pad rows
    middle = TrainingInputBatch.cat(parts[1])  # rows 0, 4, 1, 5, 2, 6, 3, 7
    assert middle["row"][[0, 2, 4, 6, 1], 0].tolist() == [3, 4, 5, 6, 7]
    assert middle["loss_mask"][[3, 5, 7]].sum() == 0 and middle.metadata["pad_size"] == 3


def test_balanced_staging_spreads_tokens_evenly(ray_cluster):
    batch = numbered_batch(8)
    staged = MeshDispatch.stage_chunks(2, batch, [(0, 8)], balance=True)
    loads = [staged[0].fetch(r)["attention_mask"].sum().item() for r in range(2)]
    assert loads == [18, 18]


def test_gather_restores_row_order_and_strips_pads_of_a_padded_middle_mini_batch(ray_cluster):
    batch = numbered_batch(11)
    bounds = [(0, 4), (4, 7), (7, 11)]  # the middle one (3 rows) needs a pad row for dp=2
    for balance in (False, True):
        for delay_split in (False, True):
            staged = MeshDispatch.stage_chunks(2, batch, bounds, balance, delay_split)
            gathered = MeshDispatch.gather(staged, rank_outputs(staged, 2, balance, delay_split))
            assert gathered["out"][:, 0].tolist() == [10.0 * i for i in range(11)], (balance, delay_split)


def test_delayed_and_driver_side_splits_give_each_rank_the_rows_of_split_train_data_by_dp(ray_cluster):
    batch = numbered_batch(11)
    bounds = [(0, 4), (4, 7), (7, 11)]
    for balance in (False, True):
        eager = MeshDispatch.stage_chunks(2, batch, bounds, balance)
        delayed = MeshDispatch.stage_chunks(2, batch, bounds, balance, delay_split=True)
        for mini_eager, mini_delayed in zip(eager, delayed, strict=True):
            whole = mini_delayed.fetch(0)
            rollout = {"tokens": [list(range(n)) for n in whole["attention_mask"].sum(-1).tolist()]}
            expected = [part["partition"] for part in split_train_data_by_dp(rollout, 2, balance)]
            assert mini_eager.rows == mini_delayed.rows == expected, balance
            for rank in range(2):
                own = whole.select_rows(partition_rows(whole, 2, balance)[rank])  # the worker's `_own_part`
                assert torch.equal(own["row"], mini_eager.fetch(rank)["row"]), (balance, rank)


def test_each_rank_gets_its_rows_of_every_mini_batch_and_group_of_fields_from_one_list_per_rank(ray_cluster):
    """What a call hands rank r (`call_args`: the staged lists and the picks) is what the worker reads
    (`rank_rows`): its rows of each mini-batch, in order, with the fields staged later beside them."""
    batch = numbered_batch(11)
    bounds = [(0, 4), (4, 7), (7, 11)]  # the middle one needs a pad row for dp=2
    later = TrainingInputBatch({"later": 100 * torch.arange(11).float()[:, None]})
    cfg = TrainerConfig()
    cfg.placement.cpus_per_worker = torch.get_num_threads()  # a worker sets its process's threads
    for delay_split in (False, True):
        staged = MeshDispatch.add_fields(
            MeshDispatch.stage_chunks(2, batch, bounds, delay_split=delay_split), later
        )
        for rank in range(2):
            lists, picks = MeshDispatch.call_args(staged, rank)
            assert len(lists) == 2  # one list per group of fields, whatever the number of mini-batches
            worker = PolicyWorker(cfg, rank, 2, "unused")  # rank_rows only: no model, no process group
            minis = worker.rank_rows(ray.get(lists), picks, 2 if delay_split else None)
            for mini, part in zip(staged, minis, strict=True):
                rows = mini.rows[rank]
                real = [i for i, row in enumerate(rows) if row < mini.end - mini.start]
                expected = [mini.start + rows[i] for i in real]
                assert part["row"][real, 0].tolist() == expected, (delay_split, rank)
                assert part["later"][real, 0].tolist() == [100 * e for e in expected], (delay_split, rank)
                pads = [i for i in range(len(rows)) if i not in real]
                assert part["loss_mask"][pads].sum() == 0, (delay_split, rank)
