"""One rank of tests/test_trl_zero3.py, started by torchrun (2 processes, gloo, DeepSpeed on CPU): `python -m
torch.distributed.run --nproc_per_node=2 tests/trl_zero3_ranks.py ROOT` with ROOT holding the tiny model (ROOT/model)
and a wider teacher (ROOT/teacher).

1. Stock `trl.GRPOTrainer` and the drop-in each train 2 steps under ZeRO-3 (beta 0 and beta > 0 with a reference
   model): their logged metrics and final parameters go to ROOT/train_<rank>.json and ROOT/<trainer>_<beta>.pt.
2. The drop-in's forward runs the fused head on a different number of rows on each rank (one row per chunk, so
   the chunk counts differ) through each route, and the torch.distributed collectives of its forward and its
   backward are recorded (ROOT/collectives_<rank>.json).
3. `zero3.gathered` alone on a partitioned lm_head: collectives and gradients per route
   (ROOT/partitioned_<rank>.json).
4. Stock `trl.DistillationTrainer` and the drop-in each distill the teacher into the model 2 steps (the JSD; TRL
   partitions the teacher under ZeRO-3 too): logs, each loss call's collectives, final parameters
   (ROOT/distill_<rank>.json, ROOT/distill_<trainer>.pt).

The process ends with os._exit: gloo's threads can abort an interpreter at exit.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter_tensor")
COLLECTIVES += ("_reduce_scatter_base", "reduce_scatter", "broadcast", "barrier", "all_to_all_single", "reduce")
COLLECTIVES += ("all_gather_coalesced", "all_reduce_coalesced", "gather", "scatter")
STEPS = 2
METRICS = ("loss", "grad_norm", "kl", "entropy")  # the logged numbers compared (not the timings)
TIMINGS = ("step_time",)
ROUTES = {  # name -> the fused head's keywords: one row per chunk / tile
    "three_gemm": dict(loss_type="dapo", chunk_size=1),
    "four_gemm": dict(loss_type="grpo", importance_sampling_level="sequence", chunk_size=1),
    "lean": dict(loss_type="dapo", memory="lean", tile=(1, 8)),
}
recorded: list[str] | None = None  # the collectives called while a list


def record_collectives() -> None:
    """Wrap torch.distributed's collectives (before DeepSpeed binds them) so that each call is appended to
    `recorded` while it is a list."""
    for module in (dist, dist.distributed_c10d):
        for name in COLLECTIVES:
            fn = getattr(module, name, None)
            if fn is None or getattr(fn, "_recorded", False):
                continue

            @functools.wraps(fn)
            def wrapper(*args, _fn=fn, _name=name, **kwargs):
                if recorded is not None:
                    recorded.append(_name)
                return _fn(*args, **kwargs)

            wrapper._recorded = True
            setattr(module, name, wrapper)


def deepspeed_config() -> dict:
    return {
        "zero_optimization": {  # every parameter partitioned, and released after each use (tiny models stay whole)
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
        },
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
    }


def reward_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def build(cls, root: str, beta: float):
    import datasets
    import trl
    from accelerate.state import AcceleratorState

    from grpo_kernels.trainer.model import build_tokenizer

    AcceleratorState._reset_state()  # one Accelerator per trainer; the gloo PartialState stays
    args = trl.GRPOConfig(per_device_train_batch_size=4, num_generations=4, beta=beta, **training_args(root))
    dataset = datasets.Dataset.from_dict({"prompt": ["abc", "de", "fgh", "ij"] * 2})
    tokenizer = build_tokenizer("abcdefghij")
    return cls(
        os.path.join(root, "model"), reward_funcs=reward_length, args=args, train_dataset=dataset,
        processing_class=tokenizer,
    )  # fmt: skip


def training_args(root: str) -> dict:
    """The config fields both trainers share: 2 SGD steps under ZeRO-3 on gloo, every step logged."""
    return dict(
        output_dir=os.path.join(root, "out"),
        max_completion_length=8,
        max_steps=STEPS,
        logging_steps=1,
        optim="sgd",  # updates linear in the gradients: parameters comparable at float32 tolerance
        learning_rate=0.1,
        max_grad_norm=1e9,  # grad_norm logged, never clipped
        report_to=[],
        bf16=False,
        save_strategy="no",
        seed=0,
        deepspeed=deepspeed_config(),
        ddp_backend="gloo",
        accelerator_config={"use_configured_state": True},
    )


def build_distillation(cls, root: str):
    """A distillation trainer of `cls`: the tiny model learns from a wider tiny teacher (ROOT/teacher), JSD."""
    import datasets
    import trl
    from accelerate.state import AcceleratorState

    from grpo_kernels.trainer.model import build_tokenizer

    AcceleratorState._reset_state()
    args = trl.DistillationConfig(per_device_train_batch_size=2, beta=0.5, temperature=0.9, **training_args(root))
    dataset = datasets.Dataset.from_dict({"prompt": ["abc", "de", "fgh", "ij"]})
    return cls(
        os.path.join(root, "model"), teacher_model=os.path.join(root, "teacher"), args=args, train_dataset=dataset,
        processing_class=build_tokenizer("abcdefghij"),
    )  # fmt: skip


def gathered_parameters(model) -> dict[str, torch.Tensor]:
    import deepspeed

    out = {}
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().clone()
    return out


def train(root: str, rank: int):
    """Both trainers, 2 steps each at beta 0 and 0.04; returns the last drop-in trainer."""
    import trl

    from grpo_kernels.integrations import trl as drop_in

    logs = {}
    for beta in (0.0, 0.04):
        for name, cls in (("stock", trl.GRPOTrainer), ("drop_in", drop_in.GRPOTrainer)):
            trainer = build(cls, root, beta)
            trainer.train()
            history = [h for h in trainer.state.log_history if "loss" in h]  # one entry per step
            logs[f"{name}_{beta}"] = [{k: h[k] for k in METRICS if k in h} for h in history]
            params = gathered_parameters(trainer.model)
            if rank == 0:
                torch.save(params, os.path.join(root, f"{name}_{beta}.pt"))
    with open(os.path.join(root, f"train_{rank}.json"), "w") as f:
        json.dump(logs, f)
    return trainer


def distill(root: str, rank: int) -> None:
    """Stock `trl.DistillationTrainer` and the drop-in, 2 steps each: their logs, the collectives each call of their
    loss function makes, whether both lm_heads are partitioned after training (ROOT/distill_<rank>.json), and their
    final parameters (ROOT/distill_<name>.pt)."""
    import trl
    from trl.trainer import distillation_trainer as stock_loss

    from grpo_kernels.integrations import trl as drop_in
    from grpo_kernels.integrations import trl_distillation as drop_in_loss

    logs = {}
    for name, cls, module, loss in (
        ("stock", trl.DistillationTrainer, stock_loss, "_chunked_divergence_loss"),
        ("drop_in", drop_in.DistillationTrainer, drop_in_loss, "chunked_divergence_loss"),
    ):
        calls: list[list[str]] = []
        setattr(module, loss, recording(getattr(module, loss), calls))  # for the rest of the process: its last step
        trainer = build_distillation(cls, root)
        trainer.train()
        history = [h for h in trainer.state.log_history if "loss" in h]  # one entry per step
        logs[name] = [{k: v for k, v in h.items() if k not in TIMINGS} for h in history]
        logs[f"{name}/loss_calls"] = calls
        heads = (trainer.model.get_output_embeddings(), trainer.teacher_model.module.get_output_embeddings())
        logs[f"{name}/partitioned_after"] = [head.weight.data.numel() == 0 for head in heads]
        params = gathered_parameters(trainer.model)
        if rank == 0:
            torch.save(params, os.path.join(root, f"distill_{name}.pt"))
    with open(os.path.join(root, f"distill_{rank}.json"), "w") as f:
        json.dump(logs, f)


def recording(fn, calls: list[list[str]]):
    """`fn`, appending to `calls` the collectives each of its calls makes."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global recorded
        recorded = []
        try:
            return fn(*args, **kwargs)
        finally:
            calls.append(recorded)
            recorded = None

    return wrapper


def collectives(trainer, root: str, rank: int) -> None:
    """Each route's collectives on rank-dependent row counts (rank r: 1 + 3r sequences of 4 + 6r tokens), through
    the DeepSpeed engine's forward and through the bare model's (as TRL calls its policy for old log-probs)."""
    global recorded
    from grpo_kernels.api import fused_linear_grpo_loss, fused_linear_token_logprobs
    from grpo_kernels.integrations.trl import HEAD_KWARG

    vocab = trainer.model.config.vocab_size
    g = torch.Generator().manual_seed(rank)
    B, L = 1 + 3 * rank, 4 + 6 * rank
    ids = torch.randint(4, vocab, (B, L), generator=g)
    attention = torch.ones_like(ids)
    advantages = torch.randn(B, generator=g)
    out = {"rows": B * (L - 1)}
    for caller, model in (("engine", trainer.model_wrapped),):
        for route, options in ROUTES.items():

            def head(last_hidden, lm, aux_loss, options=options):
                return fused_linear_grpo_loss(last_hidden[:, :-1], lm.weight, ids[:, 1:], advantages, **options)

            recorded = []
            loss = model(input_ids=ids, attention_mask=attention, **{HEAD_KWARG: head}).loss
            forward, recorded = recorded, []
            trainer.model_wrapped.backward(loss)
            out[f"{caller}/{route}"] = {"forward": forward, "backward": recorded}
            recorded = None
            trainer.model_wrapped.zero_grad()

        def logprobs(last_hidden, lm, aux_loss):
            return fused_linear_token_logprobs(last_hidden[:, :-1], lm.weight, ids[:, 1:], chunk_size=1)

        recorded = []
        with torch.no_grad():
            model(input_ids=ids, attention_mask=attention, **{HEAD_KWARG: logprobs})
        out[f"{caller}/logprobs"], recorded = {"forward": recorded}, None
    with open(os.path.join(root, f"collectives_{rank}.json"), "w") as f:
        json.dump(out, f)


def partitioned_head(root: str, rank: int) -> None:
    """`zero3.gathered` alone, on an lm_head that ZeRO-3 holds partitioned and no module hook gathers: each route
    on rank-dependent rows (and with no row kept on rank 0), its collectives and its gradients against the
    gathered weight's."""
    global recorded
    import deepspeed

    from grpo_kernels.api import fused_linear_grpo_loss
    from grpo_kernels.integrations import zero3

    sizes = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    with deepspeed.zero.Init(config_dict_or_path={**deepspeed_config(), **sizes}):
        head = torch.nn.Linear(32, 14)
    assert head.weight.data.numel() == 0, "the weight is not partitioned"
    with deepspeed.zero.GatheredParameters([head.weight, head.bias]):
        whole = (head.weight.detach().clone(), head.bias.detach().clone())
    g = torch.Generator().manual_seed(rank)
    rows = 2 + 9 * rank
    hidden = torch.randn(1, rows, 32, generator=g, dtype=torch.float32).requires_grad_()
    targets, advantages = torch.randint(0, 14, (1, rows), generator=g), torch.randn(1, generator=g)
    out = {}
    for (route, options), masked in itertools.product(ROUTES.items(), (False, True)):
        mask = torch.full((1, rows), not (masked and rank == 0))  # "masked": no row kept on rank 0
        recorded = []
        with zero3.gathered(head.weight, head.bias):
            loss = fused_linear_grpo_loss(
                hidden, head.weight, targets, advantages, mask=mask, bias=head.bias, **options
            )
        forward, recorded = recorded, []
        grads = torch.autograd.grad(loss.loss, (hidden, head.weight, head.bias))
        backward, recorded = recorded, None
        weight, bias = (x.clone().requires_grad_() for x in whole)
        loss_ref = fused_linear_grpo_loss(hidden, weight, targets, advantages, mask=mask, bias=bias, **options)
        expected = torch.autograd.grad(loss_ref.loss, (hidden, weight, bias))
        error = max((a - b).abs().max().item() for a, b in zip(grads, expected, strict=True))
        out[f"{route}/masked" if masked else route] = {
            "forward": forward, "backward": backward, "error": error, "loss": (loss.loss - loss_ref.loss).item()
        }  # fmt: skip
    out["partitioned_after"] = head.weight.data.numel() == 0
    with deepspeed.zero.GatheredParameters([head.weight, head.bias]):  # held gathered by another owner (as
        recorded = []  # embed_tokens holds a tied head): neither gathered again nor partitioned by the fused pass
        with zero3.gathered(head.weight, head.bias):
            loss = fused_linear_grpo_loss(hidden, head.weight, targets, advantages, bias=head.bias, **ROUTES["lean"])
        still_gathered = head.weight.data.numel() > 0
        torch.autograd.grad(loss.loss, (hidden, head.weight, head.bias))
        out["held"], recorded = {"calls": recorded, "still_gathered": still_gathered}, None
    with open(os.path.join(root, f"partitioned_{rank}.json"), "w") as f:
        json.dump(out, f)


def main(root: str) -> None:
    record_collectives()
    torch.set_num_threads(1)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # no C++ shm op build on CPU
    from accelerate import PartialState

    PartialState(backend="gloo")
    rank = int(os.environ["RANK"])
    trainer = train(root, rank)
    collectives(trainer, root, rank)
    partitioned_head(root, rank)
    distill(root, rank)


if __name__ == "__main__":
    status = 0
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
