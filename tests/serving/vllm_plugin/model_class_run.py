"""Build the plugin's model class for a folder and load its weights, without an engine and without a kernel, then
run every layer's projections on fixed inputs: `python model_class_run.py FOLDER OUTPUT [--explicit]`
(test_vllm_model_class.py runs it in a process of its own).

Wherever vLLM's platform is not its CPU build's (its CUDA build, with a GPU or without one), the process takes vLLM's
CPU platform without its configuration step (which asks for triton-cpu): building the model, loading weights and
making the CPU backend's metadata builder run no kernel, so the plugin's classes are checked the same way on any
vLLM release the plugin lists.
"""

import socket
import sys

import torch


def use_cpu_platform_without_kernels() -> None:
    import vllm.platforms as platforms
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return
    from vllm.platforms.cpu import CpuPlatform

    class KernelFreeCpuPlatform(CpuPlatform):
        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:
            pass

    platforms._current_platform = KernelFreeCpuPlatform()


def build_model(folder: str, explicit: bool):
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    import iha.serving.vllm as plugin

    plugin.register()
    arguments = EngineArgs(
        model=folder, dtype="float32", enforce_eager=True, max_model_len=256, block_size=32, skip_tokenizer_init=True
    )
    if explicit:
        arguments.hf_overrides = {"iha_fold_mixing": False}
    vllm_config = arguments.create_engine_config()
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
        from iha.serving.vllm.model import IHAForCausalLM

        return IHAForCausalLM(vllm_config=vllm_config), vllm_config


def main(folder: str, output_file: str, explicit: bool) -> None:
    from safetensors.torch import load_file

    from iha.serving.vllm.attention.cpu import IHACPUAttentionMetadataBuilder

    model, vllm_config = build_model(folder, explicit)
    loaded = model.load_weights(load_file(f"{folder}/model.safetensors").items())
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, model.config.hidden_size, generator=generator)
    layers = []
    with torch.no_grad():
        for layer in model.model.layers:
            attention = layer.self_attn
            # The projections' own function on one rank, with their loaded weights: the CPU build's linear layers
            # compute through weights it packs when the engine starts, which this process never does.
            qkv = torch.nn.functional.linear(hidden, attention.qkv_proj.weight, attention.qkv_proj.bias)
            q, k, v = qkv.split([attention.q_size, attention.kv_size, attention.kv_size], -1)
            num_pseudo, head_dim = attention.num_pseudo_heads, attention.head_dim
            pseudo_outputs = torch.randn(5, num_pseudo * attention.num_heads * head_dim, generator=generator)
            if attention.head_mixing is not None:
                q, k, v = attention.head_mixing.mix_qkv(q, k, v)
                pseudo_outputs_in = attention.head_mixing.collapse_heads(pseudo_outputs)
            else:
                pseudo_outputs_in = pseudo_outputs
            output = None
            if attention.is_iha:
                output = torch.nn.functional.linear(pseudo_outputs_in, attention.o_proj.weight, attention.o_proj.bias)
            layers.append({"q": q, "k": k, "v": v, "output": output, "folded": attention.fold_mixing})
    # The CPU backend's metadata builder of the first IHA layer: vLLM's, on the virtual spec.
    attention = next(layer.self_attn.attn for layer in model.model.layers if layer.self_attn.is_iha)
    spec = attention.get_kv_cache_spec(vllm_config)
    builder = IHACPUAttentionMetadataBuilder(spec, [attention.layer_name], vllm_config, torch.device("cpu"))
    kernel_view = {"spec": (spec.head_size, spec.block_size), "kernel": (builder.head_dim, builder.block_size)}
    kernel_view["isa"] = (builder.isa, attention.isa)
    parameters = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    with open(output_file, "wb") as file:
        torch.save(
            {"loaded": sorted(loaded), "parameters": parameters, "layers": layers, "kernel_view": kernel_view}, file
        )


if __name__ == "__main__":
    use_cpu_platform_without_kernels()
    main(sys.argv[1], sys.argv[2], "--explicit" in sys.argv[3:])
