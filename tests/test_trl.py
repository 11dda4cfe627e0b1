"""grpo_kernels.integrations.trl against stock TRL 1.16: the same `inputs` (the keys TRL's `_prepare_inputs` yields,
built by hand) through `compute_loss` of both trainers give the same loss, the same gradient on every parameter and
the same logged metrics; a 3-step `train()` with HF generation logs the same metrics; unsupported options raise.

Tiny models are built from a config and saved to a temporary directory (TRL builds the reference model from the
policy's path); the tokenizer is the demo's character-level one. Everything runs in float32 (`bf16=False`).
"""

import inspect
import math
import tempfile
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from grpo_kernels.engine import memory  # noqa: E402
from grpo_kernels.integrations import trl as drop_in  # noqa: E402
from grpo_kernels.trainer.model import build_tokenizer  # noqa: E402
from tests.conftest import assert_close  # noqa: E402

P, T = 3, 6  # prompt and completion lengths of the hand-built batches
LENGTHS = (6, 1, 4, 5)  # completion lengths (EOS included) of the 4 sequences
METRIC_TOL = dict(rel_tol=1e-5, abs_tol=1e-6)
TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
# TRL's per-sequence clip extremes need each sequence's clip fraction, which the fused loss does not report yet
# (GRPOLossOutput.metrics has no `clip_ratio/low_min` / `clip_ratio/high_max`): while they are missing, only
# test_clip_extremes_logged_like_trl fails on them, and every other number is still checked everywhere
CLIP_EXTREMES = ("clip_ratio/low_min", "clip_ratio/high_max")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
OUTPUT_DIR = str(Path(tempfile.gettempdir()) / "grpo_kernels_test_trl")  # nothing is saved; Trainer wants one


def _sizes(tokenizer, **extra):
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )


MODELS = {  # name -> a tiny model built from a config for the tokenizer
    "qwen2": lambda tok: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_sizes(tok))),  # untied, biases
    "qwen2_moe": lambda tok: transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(
            **_sizes(tok, moe_intermediate_size=16, shared_expert_intermediate_size=16),
            num_experts=4,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.05,
        )
    ),
    "gemma2_softcap": lambda tok: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**_sizes(tok, head_dim=16), final_logit_softcapping=2.0, query_pre_attn_scalar=16)
    ),
    "granite_scaled": lambda tok: transformers.GraniteForCausalLM(
        transformers.GraniteConfig(**_sizes(tok), logits_scaling=4.0)
    ),
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("abcdefghij")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, tokenizer):
    """name -> a directory holding that tiny model (built once, seeded)."""
    root = tmp_path_factory.mktemp("trl_models")

    def path(name: str = "qwen2") -> str:
        target = root / name
        if not target.exists():
            torch.manual_seed(0)
            MODELS[name](tokenizer).save_pretrained(target)
        return str(target)

    return path


def reward_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def build(cls, path, tokenizer, peft_config=None, **config):
    """A trainer of `cls` on the model at `path`; `config` overrides GRPOConfig's fields."""
    defaults = dict(
        output_dir=OUTPUT_DIR,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
    )
    args = trl.GRPOConfig(**{**defaults, **config})
    dataset = datasets.Dataset.from_dict({"prompt": ["abc", "de", "fgh", "ij"]})
    return cls(
        path,
        reward_funcs=reward_length,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def make_inputs(trainer, *, seed=0, old=True, ref=False, per_token_advantages=False):
    """A batch with TRL's `_prepare_inputs` keys: left-padded prompts, right-padded completions, advantages,
    num_items_in_batch, and (optionally) old / reference log-probs near the policy's own (ratios spread around 1)."""
    g = torch.Generator().manual_seed(seed)
    B, vocab = len(LENGTHS), trainer.model.config.get_text_config().vocab_size
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, 0] = 0
    completion_mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).long()  # [B, T]
    inputs = {
        "prompt_ids": torch.randint(4, vocab, (B, P), generator=g),
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(4, vocab, (B, T), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.randn((B, T) if per_token_advantages else (B,), generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }
    with torch.no_grad():  # stock TRL's own log-prob pass (0 at padding, as TRL's inputs have it)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([prompt_mask, completion_mask], 1)
        logp = trl.GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, attention, T)[0]
    noise = lambda scale: scale * torch.randn(B, T, generator=g) * completion_mask  # noqa: E731
    if old:
        inputs["old_per_token_logps"] = logp + noise(0.3)
    if ref:
        inputs["ref_per_token_logps"] = logp + noise(0.5)
    return inputs


def step(trainer, inputs, mode="train", accumulation=1):
    """compute_loss + backward as the Trainer's training step runs them: (loss, grads, last logged metrics)."""
    trainer.model.train(mode == "train")
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = accumulation
    trainer._metrics[mode].clear()
    loss = trainer.compute_loss(trainer.model, dict(inputs))
    if mode == "train":
        loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, {name: values[-1] for name, values in trainer._metrics[mode].items()}


# The parameters whose gradients a float32 head forms without passing through the layers below it.
HEAD_PARAMETERS = ("lm_head.weight", "model.norm.weight")


def assert_same(stock, ours, inputs, layers_dtype=torch.float32, **kwargs):
    """Stock TRL and the drop-in agree on the loss, every parameter's gradient, and every logged metric (but the
    clip extremes, see CLIP_EXTREMES); returns TRL's loss and metrics.

    `layers_dtype` is the dtype the layers below the head compute their backward in (bfloat16 under bf16 autocast).
    Their gradients are then two low-precision computations fed by heads that agree to float32 rounding, so they
    are held to that dtype's tolerance: whether a bf16 rounding flips depends on the CPU's vector instructions
    (identical under ATEN_CPU_CAPABILITY=default, up to 2e-3 of the scale under avx2 and avx512). The head's own
    parameters stay at float32's."""
    loss_a, grads_a, metrics_a = step(stock, inputs, **kwargs)
    loss_b, grads_b, metrics_b = step(ours, inputs, **kwargs)
    metrics_a = {k: v for k, v in metrics_a.items() if k in metrics_b or k not in CLIP_EXTREMES}
    assert_close(loss_b, loss_a, torch.float32, "loss")
    assert set(grads_b) == set(grads_a)
    for name in grads_a:
        assert_close(grads_b[name], grads_a[name], torch.float32 if name in HEAD_PARAMETERS else layers_dtype, name)
    assert set(metrics_b) == set(metrics_a), f"metric names differ: {set(metrics_a) ^ set(metrics_b)}"
    for name, value in metrics_a.items():
        both_nan = math.isnan(value) and math.isnan(metrics_b[name])
        assert both_nan or math.isclose(metrics_b[name], value, **METRIC_TOL), f"{name}: {metrics_b[name]} != {value}"
    return loss_a, metrics_a


def pair(model_path, tokenizer, name="qwen2", peft_config=None, **config):
    path = model_path(name)
    return (
        build(trl.GRPOTrainer, path, tokenizer, peft_config, **config),
        build(drop_in.GRPOTrainer, path, tokenizer, peft_config, **config),
    )


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_same_loss_gradients_and_metrics_as_trl(model_path, tokenizer, loss_type, level, beta):
    """Every TRL loss type × importance-sampling level, with and without the KL to a reference model, with
    num_iterations = 2 (old log-probs given)."""
    if loss_type == "vespo" and level == "sequence" and beta != 0.0:
        pytest.skip("refused at construction (test_unsupported_options_raise)")
    config = dict(loss_type=loss_type, importance_sampling_level=level, beta=beta, num_iterations=2)
    stock, ours = pair(model_path, tokenizer, epsilon_high=0.28, **config)
    loss, metrics = assert_same(stock, ours, make_inputs(stock, ref=beta != 0.0))
    assert loss != 0.0 and "entropy" in metrics


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_clip_extremes_logged_like_trl(model_path, tokenizer, loss_type, level):
    """TRL logs, for the clipped losses, the smallest per-sequence fraction of low-clipped tokens and the largest of
    high-clipped ones (over all processes). Fails until the fused loss reports each batch's local extremes as
    `clip_ratio/low_min` and `clip_ratio/high_max` (nanmin / nanmax over sequences with a kept token of the
    sequence's clip-flag mean; at sequence level, of each sequence's flag), which the drop-in reduces over processes."""
    stock, ours = pair(model_path, tokenizer, loss_type=loss_type, importance_sampling_level=level, epsilon_high=0.28)
    inputs = make_inputs(stock, seed=2)
    expected, actual = step(stock, inputs)[2], step(ours, inputs)[2]
    for name in CLIP_EXTREMES:
        assert name in actual, f"{name} is not logged"
        assert math.isclose(actual[name], expected[name], **METRIC_TOL), f"{name}: {actual[name]} != {expected[name]}"


CASES = {  # name -> (GRPOConfig fields, make_inputs fields, trainer attributes set on both, step fields)
    "on_policy": (dict(loss_type="grpo"), dict(old=False), {}, {}),
    "per_token_advantages": (dict(loss_type="dapo"), dict(per_token_advantages=True), {}, {}),
    "delta": (dict(loss_type="grpo", delta=1.1, epsilon_high=0.28), {}, {}, {}),
    "no_bias_correction_kl": (dict(loss_type="bnpo", beta=0.1, use_bias_correction_kl=False), dict(ref=True), {}, {}),
    "dr_grpo_length": (dict(loss_type="dr_grpo", max_completion_length=16), {}, {}, {}),
    "cispo_cap": (dict(loss_type="cispo", epsilon_high=1.1), {}, {}, {}),
    "sapo_temperatures": (dict(loss_type="sapo", sapo_temperature_pos=0.7, sapo_temperature_neg=1.3), {}, {}, {}),
    "vespo_params": (dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5), {}, {}, {}),
    "entropy_bonus_grpo": (dict(loss_type="grpo", entropy_coef=0.05), {}, {}, {}),
    "entropy_bonus_dapo": (dict(loss_type="dapo", entropy_coef=0.05, gradient_accumulation_steps=2), {}, {}, {}),
    "adaptive_entropy": (
        dict(loss_type="dapo", use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=10.0),
        {},
        {"_last_world_entropy": 1.0},  # below the target: the bonus acts, then the controller steps
        {},
    ),
    "accumulation_grpo": (dict(loss_type="grpo", gradient_accumulation_steps=2), {}, {}, dict(accumulation=2)),
    "accumulation_dapo": (
        dict(loss_type="dapo", gradient_accumulation_steps=4, steps_per_generation=2),
        {},
        {},
        dict(accumulation=4),
    ),
    "eval_cispo": (dict(loss_type="cispo"), {}, {}, dict(mode="eval")),
    "eval_grpo_beta": (dict(loss_type="grpo", beta=0.04), dict(ref=True), {}, dict(mode="eval")),
    "top_entropy_quantile": (dict(loss_type="dapo", top_entropy_quantile=0.5, beta=0.04), dict(ref=True), {}, {}),
    "top_entropy_quantile_bonus": (dict(loss_type="grpo", top_entropy_quantile=0.3, entropy_coef=0.05), {}, {}, {}),
}


@pytest.mark.parametrize("case", CASES)
def test_same_numbers_per_option(model_path, tokenizer, case):
    config, input_fields, attributes, step_fields = CASES[case]
    stock, ours = pair(model_path, tokenizer, **config)
    for trainer in (stock, ours):
        for name, value in attributes.items():
            setattr(trainer, name, value)
    assert_same(stock, ours, make_inputs(stock, **input_fields), **step_fields)
    if case == "adaptive_entropy":
        assert stock.entropy_coef == ours.entropy_coef != 0.01  # the controller moved, identically
        assert stock._last_world_entropy == pytest.approx(ours._last_world_entropy, rel=1e-6)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
@pytest.mark.parametrize("loss_type", ["grpo", "vespo"])
def test_same_numbers_with_vllm_importance_sampling_ratio(model_path, tokenizer, loss_type, mode):
    """`importance_sampling_ratio` multiplies the policy term (vespo: folded into φ). TRL reads `use_vllm` at loss
    time only, so it is set on the built trainers (vLLM itself is not needed for the loss)."""
    if loss_type == "vespo" and mode.startswith("sequence"):
        pytest.skip("TRL refuses VESPO with sequence-level IS modes")
    stock, ours = pair(model_path, tokenizer, loss_type=loss_type, vllm_importance_sampling_mode=mode)
    inputs = make_inputs(stock)
    g = torch.Generator().manual_seed(5)
    shape = (len(LENGTHS), T) if mode.startswith("token") else (len(LENGTHS), 1)
    ratio = torch.exp(0.2 * torch.randn(shape, generator=g)).clamp(max=1.2)
    if mode.startswith("token"):  # TRL's token ratios are exp(0) = 1 at padding
        ratio = torch.where(inputs["completion_mask"].bool(), ratio, 1.0)
    inputs["importance_sampling_ratio"] = ratio
    for trainer in (stock, ours):
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    assert_same(stock, ours, inputs)


def test_same_numbers_with_tool_mask(model_path, tokenizer):
    stock, ours = pair(model_path, tokenizer, loss_type="grpo", beta=0.04)
    inputs = make_inputs(stock, ref=True)
    tool_mask = torch.ones(len(LENGTHS), T, dtype=torch.long)
    tool_mask[0, 1:3] = 0  # tool output inside the first completion
    inputs["tool_mask"] = tool_mask
    inputs["num_items_in_batch"] = (inputs["completion_mask"] * tool_mask).sum()
    assert_same(stock, ours, inputs)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_same_off_policy_sequence_mask(model_path, tokenizer, loss_type):
    """off_policy_mask_threshold against the sampler's log-probs (a NaN among them counts as no evidence, as in
    TRL's get_off_policy_mask): some negative-advantage sequences are dropped."""
    stock, ours = pair(model_path, tokenizer, loss_type=loss_type, off_policy_mask_threshold=0.05)
    inputs = make_inputs(stock, seed=3)
    g = torch.Generator().manual_seed(7)
    sampling = inputs["old_per_token_logps"] + 0.4 * torch.randn(len(LENGTHS), T, generator=g).abs()
    sampling[2, 1] = float("nan")
    inputs["sampling_per_token_logps"] = sampling
    inputs["advantages"] = torch.tensor([-1.0, 0.5, -0.5, -2.0])
    assert_same(stock, ours, inputs)


def test_same_numbers_with_moe_aux_loss(model_path, tokenizer):
    stock, ours = pair(model_path, tokenizer, "qwen2_moe", loss_type="grpo")
    assert stock.aux_loss_enabled
    _, metrics = assert_same(stock, ours, make_inputs(stock))
    assert metrics["aux_loss"] > 0


def test_same_numbers_with_peft(model_path, tokenizer):
    """LoRA: gradients reach the adapters only, and the reference log-probs (the base model, adapter disabled, as
    TRL takes them without a reference model) match TRL's."""
    peft = pytest.importorskip("peft")
    from trl.trainer.utils import use_adapter

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    stock, ours = pair(model_path, tokenizer, peft_config=lora, loss_type="dapo", beta=0.04)
    assert stock.ref_model is None
    for trainer in (stock, ours):  # a trained-looking adapter (LoRA's B starts at 0: the adapter would be a no-op)
        torch.manual_seed(1)
        with torch.no_grad():
            for name, parameter in trainer.model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(std=0.2)
    inputs = make_inputs(stock, ref=True)
    _, grads, _ = step(ours, inputs)
    assert grads and all("lora_" in name for name in grads)
    assert_same(stock, ours, inputs)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        with use_adapter(stock.model, adapter_name=None):
            expected = stock._get_per_token_logps_and_entropies(stock.model, ids, attention, T)[0]
        with use_adapter(ours.model, adapter_name=None):
            actual = ours._get_per_token_logps_and_entropies(ours.model, ids, attention, T)[0]
        with_adapter = ours._get_per_token_logps_and_entropies(ours.model, ids, attention, T)[0]
    assert_close(actual, expected, torch.float32, "reference logp")
    assert (with_adapter - actual).abs().max() > 1e-3


def test_old_and_reference_logprob_pass_matches_trl(model_path, tokenizer):
    """The no-grad passes (old log-probs and entropies, reference log-probs) in chunks of `batch_size` equal TRL's
    (TRL's reference head computes no entropy)."""
    stock, ours = pair(model_path, tokenizer, beta=0.04)
    inputs = make_inputs(stock)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        for trainer_model, entropy in (("model", True), ("ref_model", False)):
            expected = stock._get_per_token_logps_and_entropies(
                getattr(stock, trainer_model), ids, attention, T, batch_size=3, compute_entropy=entropy
            )
            actual = ours._get_per_token_logps_and_entropies(
                getattr(ours, trainer_model), ids, attention, T, batch_size=3, compute_entropy=entropy
            )
            assert_close(actual[0], expected[0], torch.float32, f"{trainer_model} logp")
            if entropy:
                assert_close(actual[1], expected[1], torch.float32, f"{trainer_model} entropy")
            else:
                assert actual[1] is expected[1] is None


def test_train_logs_the_same_metrics_as_trl(model_path, tokenizer):
    """3 optimizer steps with HF generation on CPU, same seed: gradient accumulation, 2 iterations per generation
    (old log-probs), a reference model; every logged number but the timings agrees."""
    config = dict(
        num_generations=4,
        max_steps=3,
        logging_steps=1,
        gradient_accumulation_steps=2,
        num_iterations=2,
        beta=0.04,
        epsilon_high=0.28,
        learning_rate=1e-2,
    )
    logs = []
    for cls in (trl.GRPOTrainer, drop_in.GRPOTrainer):
        trainer = build(cls, model_path("qwen2"), tokenizer, **config)
        trainer.train()
        logs.append(trainer.state.log_history)
    stock, ours = logs
    assert len(stock) == len(ours) == 4  # 3 steps + the train summary
    for a, b in zip(stock, ours, strict=True):
        a = {k: v for k, v in a.items() if k in b or k not in CLIP_EXTREMES}
        assert set(a) == set(b), f"logged names differ: {set(a) ^ set(b)}"
        for name, value in a.items():
            if name not in TIMING:
                assert math.isclose(b[name], value, rel_tol=1e-4, abs_tol=1e-5), f"{name}: {b[name]} != {value}"


def test_patch_switches_a_built_trainer(model_path, tokenizer):
    stock = build(trl.GRPOTrainer, model_path("qwen2"), tokenizer, loss_type="dapo")
    patched = build(trl.GRPOTrainer, model_path("qwen2"), tokenizer, loss_type="dapo")
    assert drop_in.patch(patched) is patched and isinstance(patched, drop_in.GRPOTrainer)
    assert drop_in.patch(patched) is patched  # idempotent
    assert_same(stock, patched, make_inputs(stock))


def test_constructor_is_trls():
    assert inspect.signature(drop_in.GRPOTrainer.__init__) == inspect.signature(trl.GRPOTrainer.__init__)
    assert issubclass(drop_in.GRPOTrainer, trl.GRPOTrainer)


def test_unsupported_options_raise(model_path, tokenizer):
    with pytest.raises(ValueError, match="use_bias_correction_kl"):
        build(
            drop_in.GRPOTrainer,
            model_path(),
            tokenizer,
            loss_type="vespo",
            importance_sampling_level="sequence",
            beta=0.04,
        )

    class CustomLoss(trl.GRPOTrainer):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs)

    with pytest.raises(ValueError, match="overrides _compute_loss"):
        drop_in.patch(build(CustomLoss, model_path(), tokenizer))
    with pytest.raises(TypeError, match="trl.GRPOTrainer"):
        drop_in.patch(object())
    ours = build(drop_in.GRPOTrainer, model_path(), tokenizer)
    inputs = make_inputs(ours)
    inputs["pixel_values"] = torch.zeros(1, 3, 4, 4)
    with pytest.raises(ValueError, match="vision inputs"):
        step(ours, inputs)


def test_fsdp2_dtensor_lm_head(model_path, tokenizer, tmp_path, monkeypatch, launches):
    """An lm_head held as a DTensor (FSDP2's sharded parameters) is gathered with full_tensor, as TRL does, once per
    fused pass whatever its number of chunks, and its gradient comes back as a DTensor: a 1-rank gloo group on
    CPU."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group yet")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        stock, ours = pair(model_path, tokenizer, loss_type="dapo")
        for trainer in (stock, ours):
            head = trainer.model.lm_head
            head.weight = torch.nn.Parameter(distribute_tensor(head.weight.detach(), mesh, [Shard(0)]))
        inputs = make_inputs(stock)
        loss_a, grads_a, _ = step(stock, inputs)
        gathers = []
        full_tensor = DTensor.full_tensor
        monkeypatch.setattr(DTensor, "full_tensor", lambda self: gathers.append(1) or full_tensor(self))
        monkeypatch.setattr(memory, "CPU_CHUNK_ROWS", 2)  # several chunks of rows
        launches.clear()
        loss_b, grads_b, _ = step(ours, inputs)
        assert len(gathers) == 1 and launches["torch"] > 2  # one pass (the loss), one gather, several chunks
        monkeypatch.undo()
        assert isinstance(grads_b["lm_head.weight"], DTensor)
        assert_close(loss_b, loss_a, torch.float32, "loss")
        for name in grads_a:
            full = lambda g: g.full_tensor() if isinstance(g, DTensor) else g  # noqa: E731
            assert_close(full(grads_b[name]), full(grads_a[name]), torch.float32, name)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["gemma2_softcap", "granite_scaled"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_same_numbers_with_logit_softcapping_and_scaling(model_path, tokenizer, name, loss_type):
    """Gemma 2's final-logit soft-capping and Granite's logit scaling, in the loss and in the log-prob pass."""
    stock, ours = pair(model_path, tokenizer, name, loss_type=loss_type, beta=0.04)
    assert_same(stock, ours, make_inputs(stock, ref=True))
    inputs = make_inputs(stock)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        expected = stock._get_per_token_logps_and_entropies(stock.ref_model, ids, attention, T)
        actual = ours._get_per_token_logps_and_entropies(ours.ref_model, ids, attention, T)
    assert_close(actual[0], expected[0], torch.float32, "reference logp")


def test_token_level_loss_takes_the_three_gemm_path(model_path, tokenizer, launches):
    """Without an entropy quantile or an off-policy mask, a token-level loss forms its gradients in the forward."""
    ours = build(drop_in.GRPOTrainer, model_path(), tokenizer, loss_type="dapo", beta=0.04, entropy_coef=0.01)
    inputs = make_inputs(ours, ref=True)
    launches.clear()
    step(ours, inputs)
    assert launches["fused_linear_token_loss"] == 1


DP_CASES = {  # the cross-process reductions of TRL's loss, metrics and entropy controls
    "dapo_num_items": dict(loss_type="dapo", beta=0.04, entropy_coef=0.02, gradient_accumulation_steps=2),
    "grpo_sequence_adaptive": dict(
        loss_type="grpo", importance_sampling_level="sequence", use_adaptive_entropy=True, entropy_target=10.0
    ),
    "top_entropy_quantile": dict(loss_type="bnpo", top_entropy_quantile=0.4),
    # a global count of 2 tokens: TRL's normaliser 2 / 2 processes · 2 / 4 = 0.5, used as it is
    "dapo_items_below_one": dict(
        loss_type="dapo", steps_per_generation=4, gradient_accumulation_steps=2, per_device_train_batch_size=2
    ),
}
GIVEN_ITEMS = {"dapo_items_below_one": 2}  # num_items_in_batch given instead of the global count


def _data_parallel_worker(rank: int, world: int, store: str, root: str) -> None:
    """One of `world` CPU processes (accelerate reads the ranks from the environment and takes the gloo group
    they joined): each holds its own half of the batch, `num_items_in_batch` is the global count, and every case
    must match stock TRL there."""
    import os

    from tests.rendezvous import join

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    join(rank, world, store)
    tokenizer = build_tokenizer("abcdefghij")
    for name, config in DP_CASES.items():
        stock = build(trl.GRPOTrainer, root, tokenizer, **config)
        ours = build(drop_in.GRPOTrainer, root, tokenizer, **config)
        assert stock.accelerator.num_processes == world, name
        inputs = make_inputs(stock, seed=rank, ref="beta" in config)
        items = inputs["completion_mask"].sum()
        torch.distributed.all_reduce(items)
        inputs["num_items_in_batch"] = torch.tensor(GIVEN_ITEMS[name]) if name in GIVEN_ITEMS else items
        for trainer in (stock, ours):
            trainer._last_world_entropy = 1.0
        accumulation = config.get("gradient_accumulation_steps", 1)
        assert_same(stock, ours, inputs, accumulation=accumulation)
        assert stock.entropy_coef == ours.entropy_coef


def test_data_parallel_reductions_match_trl(model_path, tmp_path):
    """2 processes: num_items_in_batch per process, the metrics' cross-process means, min and max, TRL's gathered
    entropy quantile and the adaptive entropy controller's global entropy, all as stock TRL computes them."""
    import torch.multiprocessing as mp

    from tests.rendezvous import rendezvous

    with rendezvous() as store:
        mp.spawn(_data_parallel_worker, args=(2, store, model_path()), nprocs=2, join=True)
