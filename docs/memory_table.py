"""Print docs/models.md's memory table: Ouro-1.4B and Huginn-0125 (3.5B) at their published config.json values,
built on the meta device (nothing allocated), sized by ``Stepper.memory_need``. Run: python docs/memory_table.py"""

import torch

from speed.models.convert_huginn import config_from_huginn
from speed.models.convert_ouro import config_from_ouro
from speed.models.looped_lm import LoopedLM

OURO = {  # ByteDance/Ouro-1.4B config.json, the fields config_from_ouro reads
    "hidden_act": "silu",
    "use_sliding_window": False,
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "total_ut_steps": 4,
    "vocab_size": 49152,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "eos_token_id": 0,
}
HUGINN = {  # tomg-group-umd/huginn-0125 config.json, the fields config_from_huginn reads
    "injection_type": "linear",
    "block_class_name": "SandwichBlock",
    "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU",
    "norm_class_name": "RMSNorm_llama",
    "rope_scaling": None,
    "n_embd": 5280,
    "n_heads": 55,
    "num_key_value_heads": 55,
    "head_dim": 96,
    "n_layers_in_recurrent_block": 4,
    "mean_recurrence": 32,
    "n_layers_in_prelude": 2,
    "n_layers_in_coda": 2,
    "padded_vocab_size": 65536,
    "vocab_size": 65536,
    "intermediate_size": 17920,
    "rope_base": 50000.0,
    "qk_bias": True,
    "bias": False,
    "norm_eps": 1e-6,
    "tie_embeddings": True,
    "eos_token_id": 65505,
}


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def main() -> None:
    print(
        "| model | dtype | weights | per token of context, per slot | branches' side entries per slot "
        "| 16 slots x 4096 positions (cache + side) |"
    )
    print("|---|---|---|---|---|---|")
    for name, config in (("Ouro-1.4B", config_from_ouro(OURO)), ("Huginn-0125", config_from_huginn(HUGINN))):
        with torch.device("meta"):
            model = LoopedLM(config)
        for dtype in (torch.float32, torch.bfloat16):
            stepper = model.to(dtype).stepper()
            one = stepper.memory_need(1, 1, 32, side=True)  # 32 positions: one attention chunk
            per_token = one.per_block // 32  # a block of the pool: 32 positions of every virtual layer
            big = stepper.memory_need(16, 1, 4096, side=True)
            print(
                f"| {name} ({config.pattern}) | {str(dtype).removeprefix('torch.')} | {gb(one.weights)} "
                f"| {per_token / 2**20:.2f} MiB | {one.side / 2**20:.2f} MiB | {gb(big.allocated)} |"
            )


if __name__ == "__main__":
    main()
