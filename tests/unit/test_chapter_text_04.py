"""Chapter 04's numbers, recomputed: the test fails when chapters/04_data_parallel.md drifts from the code."""

from pathlib import Path

from torch.utils.data import DistributedSampler

from distlab import comm, memory, models

TEXT = (Path(__file__).resolve().parents[2] / "chapters" / "04_data_parallel.md").read_text()
GIB = 2**30


def says(phrase: str) -> None:
    assert phrase in TEXT, f"chapter 04 no longer says {phrase!r}: the code computes it; update the text"


def test_bytes_per_step_of_the_tiny_model():
    tiny = models.preset("tiny")
    payload = comm.zero_step_bytes(tiny.num_params(), stage=0)["all_reduce"]
    says(f"The tiny transformer has {tiny.num_params():,} parameters, so each step all-reduces {payload:,} bytes")
    sent = comm.bytes_sent_per_rank("all_reduce", payload, 4)
    says(f"{sent:,.0f} bytes per rank per step on 4 ranks")
    tensors = len(list(models.build_transformer(tiny, seed=0).parameters()))
    says(f"The by-hand version issues {tensors} all-reduces per step, one per parameter tensor")


def test_the_a100_preset_numbers():
    a100 = models.preset("a100")
    grads = comm.zero_step_bytes(a100.num_params(), stage=0)["all_reduce"]
    says(f"it is {grads / 1e9:.2f} GB per step, and each of 4 ranks\nsends "
         f"{comm.bytes_sent_per_rank('all_reduce', grads, 4) / 1e9:.2f} GB")
    state = memory.training_state_bytes(a100.num_params(), "fp32").total
    bucket_copy = a100.num_params() * 4  # DDP's buckets: a second fp32 copy of every gradient (the default)
    says(f"Its fp32 training state is {state / GIB:.1f} GiB per GPU")
    says(f"a second copy of the gradients ({bucket_copy / GIB:.1f} GiB")
    says(f"{(state + bucket_copy) / GIB:.1f} GiB of the A100-40GB's 40 GiB before activations")
    says(f"Each step all-reduces {grads / 1e9:.2f} GB\nof gradients")


def test_the_sampler_pads_so_every_rank_runs_the_same_number_of_steps():
    # 10 samples on 4 ranks: 3 each, two samples served twice (as the chapter says: equal steps, not an exact mean)
    indices = [list(DistributedSampler(range(10), num_replicas=4, rank=r, shuffle=False)) for r in range(4)]
    assert [len(i) for i in indices] == [3, 3, 3, 3]
    served = sorted(sum(indices, []))
    assert set(served) == set(range(10)) and len(served) == 12  # two repeats
    says("so that every rank runs the same number of steps and therefore the same collectives")
    assert "pads the dataset for the same reason" not in TEXT
