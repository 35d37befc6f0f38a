"""What the vLLM plugin's tests share: tiny IHA folders with random mixing, the transformers reference (greedy tokens
of `generate()` and float64 log-probabilities), and vLLM engines run inside the test process.

An engine inside the test process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the "uni" executor) starts in a few seconds
where one with its own processes takes a minute on this machine's two cores; tests that need processes (tensor
parallelism, `vllm serve`) start them themselves.
"""

import gc
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from testing_utils import randomize_mixing

import iha


# vLLM reads these when an engine starts: a 1 GiB CPU KV cache (its default takes a share of the machine's memory),
# no binding of OpenMP threads to cores (the machine is shared), the engine inside this process.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Tiny models, one thread: the reference's OpenMP threads would otherwise spin-wait for a core on a shared machine
# (measured here beside two busy processes: 24 greedy tokens of `generate()` in 4.4 s on 2 threads, 0.15 s on 1).
# vLLM's CPU worker takes one thread per core it may use, itself.
torch.set_num_threads(1)

# d = 32, a head size vLLM's CPU kernel takes; H = 4 query heads over H_kv = 2 KV heads (GQA) unless a case says.
TINY_VLLM = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
)
# Block size 32 (the CPU kernel takes multiples of 32), so that prompts of ~100 tokens span several blocks and share
# whole ones; 32 new tokens per step at most, so that they are prefilled in chunks.
ENGINE_SETTINGS = dict(
    skip_tokenizer_init=True,
    enforce_eager=True,
    dtype="float32",
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    block_size=32,
    distributed_executor_backend="uni",
    seed=0,
)
# On a CUDA GPU the IHA layers run on vLLM's FlashAttention backend, which computes in bfloat16 and float16 only: the
# engines there run in bfloat16 (and follow the float64 reference within bf16 rounding), each with a small share of
# the GPU's memory and a 1 GiB KV cache (vLLM's default reserves 92% of the GPU for one engine, and the engines of a
# test module start one after another in this process).
CUDA_ENGINE_SETTINGS = dict(dtype="bfloat16", gpu_memory_utilization=0.2, kv_cache_memory_bytes=2**30)
# Log-probabilities of vLLM's float32 engine against the float64 reference; of its bfloat16 engine (8 bits of
# mantissa: 2^-8 relative error per rounding, over logits of a few units).
LOGPROB_TOLERANCE = 1e-4
BF16_LOGPROB_TOLERANCE = 0.1


def tiny_iha_folder(folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """Save a tiny IHA model with random (non-identity) mixing into `folder` (in `dtype`; the mixing stays fp32)."""
    torch.manual_seed(seed)
    model = iha.IHAForCausalLM(iha.IHAConfig(**{**TINY_VLLM, **overrides})).eval()
    randomize_mixing(model, scale=0.5, seed=seed)
    model.generation_config.eos_token_id = None  # greedy runs of a fixed length, as vLLM's `ignore_eos`
    if dtype != torch.float32:  # as `from_pretrained(dtype=...)` keeps them: the mixing in fp32, the rest in `dtype`
        for name, parameter in model.named_parameters():
            if ".head_mixing." not in name:
                parameter.data = parameter.data.to(dtype)
        model.config.dtype = dtype
    model.save_pretrained(folder)
    return folder


def tiny_gemma3_folder(folder, seed: int = 0, **overrides):
    """A tiny IHA Gemma 3 with random mixing and norms away from Gemma's zero init (so that each (1 + w) counts), a
    `query_pre_attn_scalar` other than head_dim, and a window of 8 tokens (the paper's flat window of 8 * P virtual
    tokens on its sliding IHA layers)."""
    torch.manual_seed(seed)
    settings = {**TINY_VLLM, "query_pre_attn_scalar": 24, "sliding_window": 8}
    config = iha.IHAGemma3Config(**{**settings, **overrides})
    config.architectures = ["IHAGemma3ForCausalLM"]
    model = iha.IHAGemma3ForCausalLM(config).eval()
    randomize_mixing(model, scale=0.5, seed=seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    return folder


def reference_model(folder: Path, identity_mixing: bool = False) -> iha.IHAForCausalLM:
    """The folder's model in float32, as transformers loads it; with `identity_mixing`, every pseudo-head a copy of
    its head (what a plugin that ignored the mixing would compute, near enough)."""
    model = iha.IHAForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if identity_mixing:
        for module in model.modules():
            if isinstance(module, iha.IHAHeadMixing):
                with torch.no_grad():
                    for name, value in module.identity_tensors().items():
                        getattr(module, name).copy_(value)
    return model


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return output[0, len(prompt) :].tolist()


def reference_logprobs(model, prompt: list[int], generated: list[int]) -> list[float]:
    """log p(generated[i] | prompt + generated[:i]) in float64, one full forward."""
    model64 = model.to(torch.float64)
    sequence = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model64(sequence).logits[0, len(prompt) - 1 : -1]
    model.to(torch.float32)
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[torch.arange(len(generated)), torch.tensor(generated)].tolist()


def reference_best_logprobs(model, prompt: list[int], generated: list[int]) -> list[float]:
    """The float64 reference's best log-probability at each step of `generated` (its greedy token's)."""
    model64 = model.to(torch.float64)
    with torch.no_grad():
        logits = model64(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
    model.to(torch.float32)
    return torch.log_softmax(logits, dim=-1).max(dim=-1).values.tolist()


def on_cuda_platform() -> bool:
    """Whether vLLM runs on a CUDA GPU here (its CUDA build on a machine with one), rather than its CPU build."""
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def engine_dtype() -> str:
    """The dtype the engines run in unless a test says: float32 on vLLM's CPU backend, bfloat16 on a CUDA GPU."""
    return CUDA_ENGINE_SETTINGS["dtype"] if on_cuda_platform() else ENGINE_SETTINGS["dtype"]


@contextmanager
def vllm_engine(folder: Path, **settings):
    """`vllm.LLM(folder)` in this process with `ENGINE_SETTINGS` (and `CUDA_ENGINE_SETTINGS` on a CUDA GPU),
    overridden by `settings`; shut down after."""
    from vllm import LLM

    on_cuda = on_cuda_platform()
    llm = LLM(str(folder), **{**ENGINE_SETTINGS, **(CUDA_ENGINE_SETTINGS if on_cuda else {}), **settings})
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        if on_cuda:  # the next engine measures the GPU's free memory: give back what this one's tensors held
            torch.cuda.empty_cache()


def greedy(max_tokens: int, logprobs: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False, logprobs=logprobs)


def tokens_prompt(prompt: list[int]):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=prompt)


def run_batch(llm, prompts: list[list[int]], lengths: list[int], logprobs: int | None = None):
    """One `generate` call over all prompts (batched by the engine), each with its own number of new tokens."""
    outputs = llm.generate(
        [tokens_prompt(prompt) for prompt in prompts],
        [greedy(length, logprobs) for length in lengths],
        use_tqdm=False,
    )
    return outputs


def run_staggered(
    llm, prompts: list[list[int]], lengths: list[int], join_steps: list[int], logprobs: int | None = None
):
    """Requests that join a running engine at the given steps (and leave when their tokens are done): the engine
    stepped by hand. Returns the completion of each request (its `outputs[0]`: tokens, log-probabilities), by its
    index."""
    engine = llm.llm_engine
    generated = {}
    pending = sorted(range(len(prompts)), key=lambda index: join_steps[index])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and join_steps[pending[0]] <= step:
            index = pending.pop(0)
            engine.add_request(str(index), tokens_prompt(prompts[index]), greedy(lengths[index], logprobs))
        for output in engine.step():
            if output.finished:
                generated[int(output.request_id)] = output.outputs[0]
        step += 1
    return generated


def chosen_logprobs(completion) -> list[float]:
    return [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]


def assert_follows_the_reference(model, prompts, completions, expected, dtype: str) -> None:
    """vLLM's completions (with their log-probabilities) of `prompts` against `expected`, the greedy tokens of the
    float32 reference. In float32: the same tokens, log-probabilities within 1e-4 of the float64 reference. In
    bfloat16 a near tie may part the tokens: each of vLLM's is the reference's best after the same prefix, or within
    bf16 rounding of it, and its log-probability is the reference's within bf16 rounding."""
    for index, (prompt, completion, wanted) in enumerate(zip(prompts, completions, expected)):
        tokens = list(completion.token_ids)
        got = chosen_logprobs(completion)
        reference = reference_logprobs(model, prompt, tokens)
        if dtype == "float32":
            assert tokens == wanted, f"request {index}: tokens {tokens} instead of the reference's {wanted}"
            worst = max(abs(value - want) for value, want in zip(got, reference))
            assert worst <= LOGPROB_TOLERANCE, f"request {index}: log-probabilities {worst:.2e} from the reference"
            continue
        assert len(tokens) == len(wanted) == len(got), f"request {index}: {len(tokens)} tokens, not {len(wanted)}"
        best = reference_best_logprobs(model, prompt, tokens)
        for step, (value, want, top) in enumerate(zip(got, reference, best)):
            assert top - want <= BF16_LOGPROB_TOLERANCE, f"request {index}, step {step}: not the reference's token"
            assert abs(value - want) <= BF16_LOGPROB_TOLERANCE, f"request {index}, step {step}: {value} vs {want}"


def completions(outputs) -> list:
    return [output.outputs[0] for output in outputs]


# Prompts of 4 to 70 tokens for the runs with ranks in processes of their own (slower to start, so fewer runs).
PROMPTS_FOR_PARALLELISM = [[1, 5, 7, 9], list(range(3, 40)), [11] * 3 + list(range(20, 87))]


# A chat template that only joins the messages' words: the reference tokenizes what it renders, as the server does.
CHAT_TEMPLATE = (
    "<s>{% for message in messages %} {{ message['content'] }}{% endfor %}{% if add_generation_prompt %} t5{% endif %}"
)


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer over the tiny model's vocabulary ("<unk>", "<s>", "</s>", then "t3" ... ): real text in,
    real token ids out, without a download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{index}": index for index in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE
    )
