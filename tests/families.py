"""Tiny random models of several model families, as GGUF files written by llama.cpp's own converter.

The default model (SmolLM2-135M, llama, head_dim 64) exercises one shape of one architecture. The families here
give the tests the others a user serves: head_dim 96/128/256, GQA and MHA, q/k norms, QKV biases, sliding-window
attention, mixture-of-experts, sentencepiece vocabularies, and each family's real chat template. Each is a
2-6 layer model with random weights (a fixed seed), saved by transformers with a tokenizer and converted by the
convert_hf_to_gguf.py of the llama.cpp that llama-cpp-python 0.3.36 vendors (mk/llama-source.sh unpacks it from
the sdist), so the GGUF carries exactly the keys, tensor names and vocab that llama.cpp expects of a real model
of that family.

    from families import FAMILIES, NOTES, make_family_model
    path = make_family_model("qwen3", tmp_dir)            # f16; "q8_0" (converter), "q4_0", "q4_k_m" (quantized)
    path = make_shape_model("qwen2-1.5b-shape", out_dir)  # a real model's full shape, q4_0 only (benchmarks)

Results are cached in out_dir under a key of the family's recipe (RECIPE, its spec, the llama.cpp version): a
second call returns the file at once, a changed recipe builds a new one. Beside each GGUF stays the HF folder it
was converted from (hf_folder(): config, bf16 safetensors, tokenizer), for engines that load safetensors. About 6
to 15 seconds a model on 2 cores, most of it the converter's start (torch, transformers).

Tokenizers (there is no network here to fetch the real ones):
  * BPE families take the default model's tokenizer (SmolLM2's, GPT-2 style byte-level BPE), from the HF folder
    syshax makes of the default GGUF. llama.cpp's converter names a BPE pre-tokenizer by the hash of the
    tokenizer's output; SmolLM2's is known to it ("smollm"), and adding special tokens (Llama 3's headers, Qwen3's
    <think>) leaves the hash alone. That pre-tokenizer is one real model's, whatever the architecture.
  * gemma2/gemma3/phi3/mistral/mixtral take a sentencepiece model, as the real ones do (the converter insists on
    tokenizer.model for gemma2 and phi3): a small BPE sentencepiece model with byte fallback is trained here in
    a fraction of a second on text of the pinned llama.cpp source (its chat templates and converter code), so it
    is the same on every machine, with each family's special tokens where its real vocabulary has them. The HF
    folder's tokenizer gives the token ids llama.cpp gives for a chat prompt.
The chat templates are the real ones the sdist ships (models/templates/*.jinja); gemma3's own template is not
among them, so it takes Gemma 2's (which refuses a system message).

Random weights: normal with std 0.1 (initializer_range), not transformers' 0.02, at which the layers barely move
the residual stream and a model with tied embeddings repeats its input token forever; Gemma's embeddings are
scaled to match (see _GEMMA_EMBED_STD). Greedy text then follows the prompt, and converted logits agree with
transformers' to about 0.01-0.05 (f16).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LLAMA_VERSION = "0.3.36"
# bump when the way models are made changes in a way the specs below do not show (a file name goes with it)
RECIPE = "1"
SEED = 1234

# the converter's own output types; the rest are made from the f16 file by llama.cpp's quantizer
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")


@dataclass(frozen=True)
class Tokenizer:
    """How a family's tokenizer is made. kind "bpe": SmolLM2's, with `special`/`added` tokens appended;
    kind "spm": a sentencepiece model trained here (vocab_size pieces; its unk/bos/eos/pad `pieces` at `ids`, -1
    for none; `control` symbols right after them), then `added` special tokens after its pieces (as Phi-3 appends
    its chat tokens); kind "wordpiece": BERT's lower-cased WordPiece vocabulary of vocab_size tokens, trained here
    as the sentencepiece model is ([PAD] [UNK] [CLS] [SEP] [MASK] first, as in bert-base-uncased). bos/eos/pad: the
    tokens that play those roles (transformers' and the GGUF's)."""

    kind: str  # "bpe", "spm" or "wordpiece"
    bos: str | None = None
    eos: str | None = None
    pad: str | None = None
    special: tuple[str, ...] = ()  # bpe: added as special (control) tokens
    added: tuple[str, ...] = ()  # bpe: added as plain tokens; spm: special tokens after the pieces
    # sentencepiece only
    vocab_size: int = 4000
    pieces: tuple[str, str, str, str] = ("<unk>", "<s>", "</s>", "<pad>")
    ids: tuple[int, int, int, int] = (0, 1, 2, -1)
    control: tuple[str, ...] = ()
    dummy_prefix: bool = True  # sentencepiece's add_dummy_prefix (Llama's, Mistral's); Gemma's has none
    hf_class: str = "LlamaTokenizer"
    # LlamaTokenizer's legacy: a text after a special token starts with "▁" too, as llama.cpp tokenizes it
    legacy: bool = True
    rstrip: tuple[str, ...] = ()  # added tokens that eat the whitespace after them (Phi-3's chat tokens)


@dataclass(frozen=True)
class Family:
    name: str
    arch: str  # transformers architecture (config.architectures[0])
    note: str  # what the family exercises
    tokenizer: Tokenizer
    template: str  # a file of the sdist's models/templates/, "smollm2": the default model's own template, "": none
    config: dict = field(default_factory=dict)
    embed_std: float | None = None  # the token embedding's init std, where not the config's initializer_range
    final_norm_weight: float | None = None  # the final norm's weights (all alike), where not the init's
    convert_args: tuple[str, ...] = ()  # the converter's extra flags for this family
    # an embedding model's pooling, as sentence-transformers' 1_Pooling/config.json names it ("mean", "cls",
    # "lasttoken"), which the converter writes as the GGUF's pooling_type; "": a chat model
    pooling: str = ""
    # the pre-tokenizer the converter writes for a vocabulary made here, whose hash it cannot know (it names a
    # BPE pre-tokenizer by the hash of a real model's token ids): "" keeps the converter's own check
    tokenizer_pre: str = ""
    # a Qwen3-Reranker: the HF folder gets the model card's heading, by which llama.cpp's converter knows one (it
    # then writes "rank" pooling, a "yes"/"no" classifier and the rerank prompt)
    reranker: bool = False


_LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")
# Mistral-7B-Instruct-v0.3's control tokens, at its ids (3..9)
_MISTRAL_CONTROL = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
_MISTRAL_SPM = Tokenizer("spm", bos="<s>", eos="</s>", control=_MISTRAL_CONTROL, vocab_size=4096)
# Gemma's layout: <pad> <eos> <bos> <unk> <mask> [@BOS@] <unused0..98> <start_of_turn>=106 <end_of_turn>=107
_GEMMA_SPM = Tokenizer("spm", bos="<bos>", eos="<eos>", pad="<pad>", pieces=("<unk>", "<bos>", "<eos>", "<pad>"),
                       ids=(3, 2, 1, 0),
                       control=("<mask>", "[@BOS@]", *(f"<unused{i}>" for i in range(99)),
                                "<start_of_turn>", "<end_of_turn>"),
                       vocab_size=4096, dummy_prefix=False, hf_class="GemmaTokenizer")
# Phi-3.5-mini: the Llama 2 sentencepiece model, then its chat tokens from id 32000 on (here from 4000 on)
_PHI3_ADDED = ("<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
               "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>")
# rstrip: Phi-3's tokenizer_config has it on all but <|endoftext|> (llama.cpp sets the same for the phi3 arch)
_PHI3_SPM = Tokenizer("spm", bos="<s>", eos="<|endoftext|>", pad="<|endoftext|>", vocab_size=4000,
                      added=_PHI3_ADDED, rstrip=_PHI3_ADDED[1:])
# Gemma multiplies its input embeddings by sqrt(hidden_size) (16): at 0.1 they drown the layers' outputs, and the
# tied head answers the input token again ("\n\n\n..."); at 0.1 / 16 they weigh what the others' do
_GEMMA_EMBED_STD = 0.1 / 16
# ... but the tied head then gives logits 16 times smaller than the others' (a greedy pick among near-ties): the
# final norm's weights at 15 (Gemma's norms scale by 1 + weight) give that factor back
_GEMMA_FINAL_NORM = 15.0
# Qwen's roles: no BOS of its own (the GGUF's bos is <|endoftext|>, as config.json's bos_token_id is in Qwen's)
_QWEN_BPE = Tokenizer("bpe", bos="<|endoftext|>", eos="<|im_end|>", pad="<|endoftext|>")
# Qwen3's tool and thinking tags are single, non-special tokens
_QWEN3_BPE = Tokenizer("bpe", bos="<|endoftext|>", eos="<|im_end|>", pad="<|endoftext|>",
                       added=("<tool_call>", "</tool_call>", "<think>", "</think>"))

# initializer_range 0.1 (transformers' default is 0.02): at 0.02 the layers barely move the residual stream, and a
# model with tied embeddings repeats its input token forever; at 0.1 its greedy text follows the prompt
_DENSE = dict(num_hidden_layers=2, intermediate_size=512, max_position_embeddings=4096, initializer_range=0.1)

FAMILY_SPECS: dict[str, Family] = {f.name: f for f in [
    Family("llama3", "LlamaForCausalLM",
           "llama arch, head_dim 128 (hidden 256, 2 heads), GQA 2:1 (1 KV head), Llama 3.1 rope scaling "
           "(rope_freqs tensor), tied embeddings, BPE + Llama 3 header tokens, Llama 3.1 template",
           Tokenizer("bpe", bos="<|begin_of_text|>", eos="<|eot_id|>", special=_LLAMA3_SPECIAL),
           "meta-llama-Llama-3.1-8B-Instruct.jinja",
           dict(_DENSE, hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                tie_word_embeddings=True, max_position_embeddings=131072,
                rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=8192))),
    Family("llama", "LlamaForCausalLM",
           "llama arch, head_dim 64, MHA (4 heads, 4 KV heads), SmolLM2's tokenizer and ChatML template as is",
           Tokenizer("bpe"), "smollm2",
           dict(_DENSE, hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=100000.0))),
    Family("qwen2", "Qwen2ForCausalLM",
           "qwen2 arch, head_dim 64, GQA 2:1, QKV biases, tied embeddings, ChatML (Qwen2.5 template)",
           _QWEN_BPE, "Qwen-Qwen2.5-7B-Instruct.jinja",
           dict(_DENSE, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    Family("qwen3", "Qwen3ForCausalLM",
           "qwen3 arch, head_dim 128 with n_head*head_dim (512) != n_embd (256), q_norm/k_norm, GQA 2:1, "
           "<think> tokens, Qwen3 template (thinking)",
           _QWEN3_BPE, "Qwen-Qwen3-0.6B.jinja",
           dict(_DENSE, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    Family("qwen3moe", "Qwen3MoeForCausalLM",
           "qwen3moe arch, MoE (8 experts, top 2, every layer), head_dim 128, q_norm/k_norm, GQA 2:1, "
           "Qwen3 template",
           _QWEN3_BPE, "Qwen-Qwen3-0.6B.jinja",
           dict(_DENSE, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, decoder_sparse_step=1,
                norm_topk_prob=True, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    Family("mistral", "MistralForCausalLM",
           "llama arch (as llama.cpp converts Mistral), head_dim 128 with n_head*head_dim (512) != n_embd "
           "(256), GQA 4:1, sentencepiece with Mistral v0.3's control tokens, Mistral Nemo template",
           _MISTRAL_SPM, "mistralai-Mistral-Nemo-Instruct-2407.jinja",
           dict(_DENSE, hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                sliding_window=None, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    Family("mixtral", "MixtralForCausalLM",
           "llama arch with MoE (4 experts, top 2), head_dim 64, GQA 2:1, sentencepiece (Mistral's), "
           "Mistral Nemo template",
           _MISTRAL_SPM, "mistralai-Mistral-Nemo-Instruct-2407.jinja",
           dict(_DENSE, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    Family("gemma2", "Gemma2ForCausalLM",
           "gemma2 arch, head_dim 256, GQA 2:1, SWA (window 64) on layer 0 and global on layer 1, attention "
           "and final logit soft-capping, sentencepiece (Gemma's layout), Gemma 2 template (no system role)",
           _GEMMA_SPM, "google-gemma-2-2b-it.jinja",
           dict(_DENSE, hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                query_pre_attn_scalar=256, sliding_window=64, attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0, tie_word_embeddings=True),
           embed_std=_GEMMA_EMBED_STD, final_norm_weight=_GEMMA_FINAL_NORM),
    Family("gemma3", "Gemma3ForCausalLM",
           "gemma3 arch (text only), head_dim 256, GQA 2:1, SWA (window 64) on 5 of 6 layers and global on "
           "the 6th (the 5:1 pattern transformers and llama.cpp both default to), two rope bases, q/k norms, "
           "sentencepiece (Gemma's layout), Gemma 2 template (Gemma 3's is not in the sdist)",
           _GEMMA_SPM, "google-gemma-2-2b-it.jinja",
           dict(_DENSE, num_hidden_layers=6, hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                head_dim=256, query_pre_attn_scalar=256, sliding_window=64, tie_word_embeddings=True),
           embed_std=_GEMMA_EMBED_STD, final_norm_weight=_GEMMA_FINAL_NORM),
    Family("phi3", "Phi3ForCausalLM",
           "phi3 arch, head_dim 96 (hidden 384, 4 heads), MHA, fused QKV and gate/up tensors, untied output, "
           "sentencepiece with Phi-3's chat tokens appended (rstrip), Phi-3.5 template; sliding_window 2047 "
           "in the file, as Phi-3-mini-4k's, which this llama.cpp ignores (Phi SWA disabled)",
           _PHI3_SPM, "microsoft-Phi-3.5-mini-instruct.jinja",
           dict(_DENSE, hidden_size=384, num_attention_heads=4, num_key_value_heads=4,
                original_max_position_embeddings=4096, sliding_window=2047, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    # the KV layouts of 2026's architectures (issue 49): the plan reads them from the header (sdk/gguf/layout.py)
    Family("gemma4", "Gemma4ForCausalLM",
           "gemma4 arch (text only), head_dim 256 (512 on the global layer), GQA 2:1, SWA (window 64) on 5 of 6 "
           "layers, per-layer input embeddings (64 wide), sentencepiece (Gemma's layout), Gemma 2 template",
           _GEMMA_SPM, "google-gemma-2-2b-it.jinja",
           dict(_DENSE, num_hidden_layers=6, hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                head_dim=256, sliding_window=64, hidden_size_per_layer_input=64, vocab_size_per_layer_input=4096,
                tie_word_embeddings=True,
                layer_types=["sliding_attention"] * 5 + ["full_attention"],
                per_layer_config={"05": {"head_dim": 512}}),
           embed_std=_GEMMA_EMBED_STD, final_norm_weight=_GEMMA_FINAL_NORM),
    Family("gpt-oss", "GptOssForCausalLM",
           "gpt-oss arch, head_dim 64, GQA 2:1, SWA (window 64) on layer 0 and global on layer 1, attention "
           "sinks, MoE (4 experts, top 2, biases), BPE, gpt-oss template",
           _QWEN_BPE, "openai-gpt-oss-120b.jinja",
           dict(_DENSE, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
                layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=150000.0))),
    Family("deepseek3", "DeepseekV3ForCausalLM",
           "deepseek2 arch (as llama.cpp converts DeepSeek V3): MLA (q and kv lora ranks 64, rope head 32, nope 64, "
           "v 64), a dense layer then a MoE layer (4 routed experts, top 2, one shared), BPE, DeepSeek V3.1 "
           "template",
           _QWEN_BPE, "deepseek-ai-DeepSeek-V3.1.jinja",
           dict(_DENSE, hidden_size=256, num_attention_heads=4, num_key_value_heads=4, intermediate_size=512,
                moe_intermediate_size=128, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=64,
                qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    Family("qwen35", "Qwen3_5ForCausalLM",
           "qwen35 arch (Qwen 3.5), a hybrid: a gated delta-net layer (a recurrent state: a short convolution and a "
           "delta-rule matrix) then a gated attention layer, head_dim 64 with partial rotary (a quarter), GQA 2:1, "
           "Qwen3 template",
           _QWEN3_BPE, "Qwen-Qwen3-0.6B.jinja",
           dict(_DENSE, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                tie_word_embeddings=True,
                rope_parameters=dict(rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.25)),
           convert_args=("--no-mtp",)),  # Qwen 3.5's checkpoints carry a next-token (MTP) layer; this one has none
    Family("qwen35moe", "Qwen3_5MoeForCausalLM",
           "qwen35moe arch (Qwen 3.5/3.6 MoE), a hybrid: a gated delta-net layer then a gated attention layer, each "
           "with MoE (8 experts, top 2, a shared expert), head_dim 64, GQA 2:1, Qwen3 template",
           _QWEN3_BPE, "Qwen-Qwen3-0.6B.jinja",
           dict(_DENSE, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.25)),
           convert_args=("--no-mtp",)),
    Family("nemotron_h", "NemotronHForCausalLM",
           "nemotron_h_moe arch (Nemotron 3 Nano's), a mamba hybrid: a Mamba2 layer, a MoE layer, an attention layer "
           "and a MoE layer (Mamba2: 16 heads of 32, 2 groups, state 16; MoE: 4 experts, top 2, a shared one, relu2), "
           "head_dim 64, GQA 2:1, ChatML (Qwen2.5 template). transformers 5 writes every Nemotron-H config with MoE "
           "keys, and this converter then reads dense MLP layers as none: the MoE form is the one it converts",
           _QWEN_BPE, "Qwen-Qwen2.5-7B-Instruct.jinja",
           dict(_DENSE, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                layers_block_type=["linear_attention", "moe", "full_attention", "moe"], num_hidden_layers=4,
                mamba_num_heads=16, mamba_head_dim=32, n_groups=2, ssm_state_size=16, conv_kernel=4, expand=2,
                chunk_size=64, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                moe_shared_expert_intermediate_size=128, n_shared_experts=1, tie_word_embeddings=False)),
    Family("mamba", "MambaForCausalLM",
           "mamba arch, recurrent only (no attention, no KV cache): each layer a short convolution and a selective "
           "scan (state 16), BPE, ChatML (Qwen2.5 template)",
           _QWEN_BPE, "Qwen-Qwen2.5-7B-Instruct.jinja",
           dict(_DENSE, hidden_size=256, state_size=16, expand=2, conv_kernel=4, tie_word_embeddings=True)),
    Family("lfm2", "Lfm2ForCausalLM",
           "lfm2 arch, a hybrid: a short-convolution layer (a recurrent state) then an attention layer, "
           "head_dim 64, GQA 2:1, BPE, LFM2.5 template",
           _QWEN_BPE, "LFM2.5-Instruct.jinja",
           dict(_DENSE, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, full_attn_idxs=[1],
                block_auto_adjust_ff_dim=False, tie_word_embeddings=True,
                rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    Family("bert-embedding", "BertModel",
           "an embedding model as bge and all-MiniLM are: the bert arch (non-causal attention, learned positions, "
           "token types, LayerNorm, GELU) with mean pooling, hidden 256, 4 heads of 64, a lower-cased WordPiece "
           "vocabulary (llama.cpp's WPM tokenizer: [CLS] text [SEP])",
           Tokenizer("wordpiece", pad="[PAD]", vocab_size=4000), "",
           dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, intermediate_size=512,
                max_position_embeddings=512, initializer_range=0.1),
           pooling="mean", tokenizer_pre="bert-bge"),
    Family("bert-reranker", "BertForSequenceClassification",
           "a cross-encoder as ms-marco-MiniLM and bge-reranker are: the bert arch with a one-output classifier, "
           "which llama.cpp's converter writes with its label and no pooling type (llama-server serves it with "
           "--reranking: the [CLS] row through the classifier; BERT's pooler layer is left out), WordPiece "
           "(a pair is [CLS] query [SEP] document [SEP])",
           Tokenizer("wordpiece", pad="[PAD]", vocab_size=4000), "",
           dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, intermediate_size=512,
                max_position_embeddings=512, initializer_range=0.1, num_labels=1),
           tokenizer_pre="bert-bge"),
    Family("qwen3-reranker", "Qwen3ForCausalLM",
           "a reranker as Qwen3-Reranker is one: the qwen3 arch, which llama.cpp's converter (by the model card) "
           "writes with pooling_type RANK, a two-row classifier of the LM head's rows for \"yes\" and \"no\", and "
           "Qwen3-Reranker's prompt as the file's \"rerank\" template; the score is P(yes)",
           _QWEN3_BPE, "Qwen-Qwen3-0.6B.jinja",
           dict(_DENSE, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
           reranker=True),
    Family("qwen3-embedding", "Qwen3ForCausalLM",
           "an embedding model as Qwen3-Embedding is one: the qwen3 arch with last-token pooling (sentence-"
           "transformers' modules.json and 1_Pooling), so the GGUF carries pooling_type LAST",
           _QWEN3_BPE, "Qwen-Qwen3-0.6B.jinja",
           dict(_DENSE, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
           pooling="lasttoken"),
]}

# families whose KV layout this engine does not carry in every mode yet (a sliding window with sinks, MLA, a
# recurrent state): the header and plan tests make them; test_families.py serves FAMILIES in cpu mode and hetero
LAYOUT_FAMILIES: list[str] = ["gemma4", "gpt-oss", "deepseek3", "lfm2", "qwen35", "qwen35moe", "nemotron_h", "mamba"]
# embedding models (a pooling type) and rerankers: served by /v1/embeddings and /v1/rerank, not chat
# (test_embeddings.py, test_rerank.py)
RERANKER_FAMILIES: list[str] = ["qwen3-reranker", "bert-reranker"]
EMBEDDING_FAMILIES: list[str] = [name for name, f in FAMILY_SPECS.items() if f.pooling]
FAMILIES: list[str] = [name for name in FAMILY_SPECS
                       if name not in LAYOUT_FAMILIES + EMBEDDING_FAMILIES + RERANKER_FAMILIES]
NOTES: dict[str, str] = {name: f.note for name, f in FAMILY_SPECS.items()}

# Real models' full shapes with random weights, for benchmarks (bench/bench_real_shape.py): what a decode step, a
# prompt and a KV handoff cost at that size does not depend on the weights' values. Not in FAMILIES, so the tests
# never build one (minutes and gigabytes each); make_shape_model() makes them, as q4_0 only. initializer_range is
# the real models' 0.02: the families' 0.1 is for tiny models' greedy text, and 28 layers of it would grow the
# residual stream toward f16's range.
SHAPE_SPECS: dict[str, Family] = {f.name: f for f in [
    Family("qwen3-embedding-0.6b-shape", "Qwen3ForCausalLM",
           "Qwen3-Embedding-0.6B's shape: qwen3 arch, hidden 1024, 28 layers, 16 heads and 8 KV heads of head_dim "
           "128, q/k norms, intermediate 3072, tied embeddings, last-token pooling; SmolLM2's 49152-token "
           "vocabulary (Qwen3's own has 151669), Qwen3 template",
           _QWEN3_BPE, "Qwen-Qwen3-0.6B.jinja",
           dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                intermediate_size=3072, max_position_embeddings=32768, initializer_range=0.02, rms_norm_eps=1e-6,
                tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
           pooling="lasttoken"),
    Family("qwen3-reranker-0.6b-shape", "Qwen3ForCausalLM",
           "Qwen3-Reranker-0.6B's shape: Qwen3-Embedding-0.6B's (qwen3 arch, hidden 1024, 28 layers, 16 heads and 8 KV "
           "heads of head_dim 128, intermediate 3072, tied embeddings), converted as a reranker (rank pooling, the "
           "yes/no classifier, the rerank prompt); SmolLM2's 49152-token vocabulary, Qwen3 template",
           _QWEN3_BPE, "Qwen-Qwen3-0.6B.jinja",
           dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                intermediate_size=3072, max_position_embeddings=32768, initializer_range=0.02, rms_norm_eps=1e-6,
                tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
           reranker=True),
    Family("qwen2-1.5b-shape", "Qwen2ForCausalLM",
           "Qwen2-1.5B's shape: qwen2 arch, hidden 1536, 28 layers, 12 heads, 2 KV heads (head_dim 128), "
           "intermediate 8960, QKV biases, tied embeddings, rope theta 1e6; SmolLM2's 49152-token vocabulary "
           "(Qwen2's own has 151936), ChatML (Qwen2.5 template)",
           _QWEN_BPE, "Qwen-Qwen2.5-7B-Instruct.jinja",
           dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                intermediate_size=8960, max_position_embeddings=32768, initializer_range=0.02, rms_norm_eps=1e-6,
                tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    Family("qwen3moe-a3b-8l-shape", "Qwen3MoeForCausalLM",
           "Qwen3-30B-A3B's layer shape, 8 of its 48 layers (to fit 24 GiB with two servers' repacked copies): "
           "qwen3moe arch, hidden 2048, 32 heads and 4 KV heads of head_dim 128, q/k norms, 128 experts of intermediate 768, "
           "top 8, every layer MoE; SmolLM2's 49152-token vocabulary (Qwen3's own has 151936), Qwen3 template",
           _QWEN3_BPE, "Qwen-Qwen3-0.6B.jinja",
           dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1,
                intermediate_size=6144, norm_topk_prob=True, max_position_embeddings=32768, initializer_range=0.02,
                rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    Family("qwen35-2b-shape", "Qwen3_5ForCausalLM",
           "Qwen 3.5 2B's shape: qwen35 arch, hidden 2048, 24 layers, three gated delta-net layers (16 key and 16 "
           "value heads of 128, a 4-wide convolution) to each gated attention layer (8 heads, 2 KV heads of "
           "head_dim 256, a quarter rotary), intermediate 6144, tied embeddings; SmolLM2's 49152-token vocabulary "
           "(Qwen 3.5's own has 248320), Qwen3 template",
           _QWEN3_BPE, "Qwen-Qwen3-0.6B.jinja",
           dict(hidden_size=2048, num_hidden_layers=24,
                layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
                num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                linear_num_value_heads=16, intermediate_size=6144, max_position_embeddings=32768,
                initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=True,
                rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25)),
           convert_args=("--no-mtp",)),
]}


class FamilyModelError(RuntimeError):
    """A family's model could not be made; the message carries the step and the tool's own error."""


@functools.cache
def llama_source() -> Path:
    """llama.cpp's converter, gguf-py and templates, unpacked from the llama-cpp-python sdist (mk/llama-source.sh)."""
    done = subprocess.run([str(REPO / "mk" / "llama-source.sh"), sys.executable], capture_output=True, text=True)
    if done.returncode != 0:
        raise FamilyModelError(f"mk/llama-source.sh failed: {done.stderr.strip()}")
    return Path(done.stdout.strip().splitlines()[-1])


def recipe_key(family: str) -> str:
    """8 hex digits of what makes the family's files (its spec less the note, RECIPE, SEED, the llama.cpp)."""
    return _spec_key(FAMILY_SPECS[family])


def _spec_key(spec: Family, *extra) -> str:
    # a field at its empty default is left out, so that adding one keeps the other families' files
    fields = {k: v for k, v in asdict(spec).items()
              if k != "note" and not (k in ("convert_args", "pooling", "tokenizer_pre", "reranker") and not v)}
    text = json.dumps([RECIPE, SEED, LLAMA_VERSION, fields, *extra], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def family_stem(family: str) -> str:
    return f"{family}-{recipe_key(family)}"


def hf_folder(family: str, out_dir: Path) -> Path:
    """The family's HF folder (config, safetensors, tokenizer) in out_dir, made if needed: the model the GGUF is
    converted from, for the engines that load safetensors."""
    out_dir = Path(out_dir)
    with _locked(out_dir, family):
        return _ensure_hf(family, out_dir)


def hf_tokenizer(family: str, out_dir: Path):
    """The HF folder's tokenizer as its tokenizer.json says, which tokenizes as the GGUF does. (AutoTokenizer in
    transformers 5 would give qwen2's folder Qwen2Tokenizer, with Qwen2's own pre-tokenizer, not SmolLM2's.)"""
    from transformers import TokenizersBackend

    return TokenizersBackend.from_pretrained(hf_folder(family, out_dir))


def make_family_model(family: str, out_dir: Path, quant: str = "f16") -> Path:
    """The GGUF of `family` in `quant` in out_dir (made the first time, then cached): f32/f16/bf16/q8_0 are written
    by the converter, any other llama.cpp file type (q4_0, q4_k_m, ...) is quantized from the f16 file."""
    if family not in FAMILY_SPECS:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    spec = FAMILY_SPECS[family]
    return _made_once(Path(out_dir), family_stem(family), quant, lambda: _ensure_hf(family, Path(out_dir)),
                      spec.convert_args, spec.tokenizer_pre)


def _made_once(out_dir: Path, stem: str, quant: str, hf: Callable[[], Path],
               convert_args: tuple[str, ...] = (), tokenizer_pre: str = "") -> Path:
    """{stem}.{quant}.gguf in out_dir, made the first time under stem's lock (tests of several processes may ask at
    once): the converter writes its own types from the HF folder hf() gives, llama.cpp's quantizer any other from the
    f16 file, which is made first and kept."""
    quant = quant.lower()
    if quant not in CONVERTER_TYPES:
        _llama_ftype(quant)  # fail early on a type llama.cpp has not
    target = out_dir / f"{stem}.{quant}.gguf"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with _locked(out_dir, stem):
        if target.is_file():
            return target
        if quant in CONVERTER_TYPES:
            _convert(hf(), target, quant, convert_args, tokenizer_pre)
        else:
            source = out_dir / f"{stem}.f16.gguf"
            if not source.is_file():
                _convert(hf(), source, "f16", convert_args, tokenizer_pre)
            _quantize(source, target, quant)
    return target


def shape_model_path(shape: str, out_dir: Path, layers: int | None = None, quant: str = "q4_0") -> Path:
    """Where make_shape_model() keeps the shape's GGUF of `quant` (layers: the layer count instead of the shape's)."""
    spec = _shape_spec(shape, layers)
    suffix = f"-{layers}l" if layers else ""
    how = "q4_0 q8_0-output" if quant == "q4_0" else quant  # q4_0 as syshaxd makes it; others as llama.cpp does
    return Path(out_dir) / f"{shape}{suffix}-{_spec_key(spec, how)}.{quant}.gguf"


def make_shape_model(shape: str, out_dir: Path, layers: int | None = None, log=print, quant: str = "q4_0") -> Path:
    """The GGUF of SHAPE_SPECS[shape] in out_dir, made the first time, then cached; layers: fewer layers (a smoke
    test of the pipeline). Made as make_family_model() makes a family's, except for what the size asks: the random
    weights are drawn in bf16 (transformers' own init, no f32 copy: a 1.5B model is 3 GB, not 6 GB), and the HF
    folder and the f16 GGUF (3 GB each) are deleted once the quantized file exists. quant "q4_0" (the default) is
    made as syshaxd quantizes: the output matrix (the token embeddings, tied) in q8_0; any other llama.cpp file type
    ("q4_k_m", "q6_k", ...) as llama.cpp's quantizer makes it by default, the file a user downloads. log(text)
    hears each step and how long it took."""
    quant = quant.lower()
    _llama_ftype(quant)  # fail early on a type llama.cpp has not
    target = shape_model_path(shape, out_dir, layers, quant)
    if target.is_file():
        return target
    spec = _shape_spec(shape, layers)
    out_dir = Path(out_dir)
    with _locked(out_dir, target.stem):
        if target.is_file():
            return target
        work = Path(tempfile.mkdtemp(prefix=f".{target.stem}.", dir=out_dir))
        try:
            t0 = time.monotonic()
            _build_hf(spec, work / "hf", low_memory=True)
            log(f"  random bf16 weights written: {time.monotonic() - t0:.0f} s")
            t1 = time.monotonic()
            f16 = work / "model.f16.gguf"
            _convert(work / "hf", f16, "f16", spec.convert_args)
            shutil.rmtree(work / "hf")
            log(f"  converted to f16 by convert_hf_to_gguf.py: {time.monotonic() - t1:.0f} s")
            t2 = time.monotonic()
            _quantize(f16, target, quant, q8_output=quant == "q4_0")
            log(f"  quantized to {quant}{' (output q8_0)' if quant == 'q4_0' else ''}: {time.monotonic() - t2:.0f} s")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def _shape_spec(shape: str, layers: int | None) -> Family:
    if shape not in SHAPE_SPECS:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPE_SPECS)}")
    spec = SHAPE_SPECS[shape]
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers: {layers} is not allowed; it must be at least 1")
        config = {**spec.config, "num_hidden_layers": layers}
        if "layer_types" in config:  # a hybrid's pattern, cut to the layers kept
            config["layer_types"] = (config["layer_types"] * layers)[:layers]
        spec = replace(spec, config=config)
    return spec


# ---------------------------------------------------------------------------------------------------------------


class _locked:
    """One builder per family (or file) and out_dir (tests of several processes may ask at once); the others wait."""

    def __init__(self, out_dir: Path, family: str):
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = family_stem(family) if family in FAMILY_SPECS else family
        self.path = out_dir / f".{stem}.lock"

    def __enter__(self):
        self.file = open(self.path, "w")
        fcntl.flock(self.file, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        self.file.close()


def _ensure_hf(family: str, out_dir: Path) -> Path:
    """(Under the family's lock.) The folder is made beside its place and renamed there whole."""
    folder = out_dir / f"{family_stem(family)}.hf"
    if folder.is_dir():
        return folder
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=out_dir))
    try:
        _build_hf(FAMILY_SPECS[family], tmp)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _build_hf(spec: Family, out: Path, low_memory: bool = False) -> None:
    """low_memory: the weights are made in bf16 from the start (a full-size shape), not in f32 and converted;
    the families' tiny models keep the f32 draw their files were made with."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    src = llama_source()
    tokenizer = _make_tokenizer(spec.tokenizer, src, out)
    if spec.template == "smollm2":
        template = tokenizer.chat_template
        if not template:
            raise FamilyModelError("the default model's tokenizer has no chat template")
        tokenizer.chat_template = template
    elif spec.template:  # "": none (an encoder, which never chats)
        tokenizer.chat_template = (src / "models" / "templates" / spec.template).read_text(encoding="utf-8")

    ids = {f"{role}_token_id": tokenizer.convert_tokens_to_ids(getattr(tokenizer, f"{role}_token"))
           for role in ("bos", "eos", "pad") if getattr(tokenizer, f"{role}_token", None)}
    config = transformers.AutoConfig.for_model(_model_type(spec.arch), vocab_size=len(tokenizer), **ids,
                                               **spec.config)
    config.architectures = [spec.arch]
    config.dtype = torch.bfloat16
    torch.manual_seed(SEED)
    model_cls = getattr(transformers, spec.arch)
    model = model_cls._from_config(config, dtype=torch.bfloat16) if low_memory else model_cls(config)
    if spec.embed_std is not None:
        torch.nn.init.normal_(model.get_input_embeddings().weight, std=spec.embed_std)
    if spec.final_norm_weight is not None:
        torch.nn.init.constant_(model.model.norm.weight, spec.final_norm_weight)
    model = model.to(torch.bfloat16).eval()  # as real checkpoints are stored; bf16 -> f16 is exact at these scales
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    if spec.pooling:
        _write_pooling(out, spec.pooling, config.hidden_size)
    if spec.reranker:
        (out / "README.md").write_text("# Qwen3-Reranker\n\nA tiny random model of its shape, for tests.\n")


def _write_pooling(out: Path, pooling: str, dim: int) -> None:
    """sentence-transformers' modules.json and 1_Pooling/config.json, as an embedding model's repository has them:
    the converter reads the pooling there."""
    (out / "1_Pooling").mkdir()
    modes = {"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
             "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": pooling == "lasttoken"}
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": dim, **modes}))
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))


def _model_type(arch: str) -> str:
    import transformers

    auto = transformers.models.auto.modeling_auto
    # a causal LM, a base model (BertModel: an encoder, no LM head) or a classifier (a cross-encoder)
    types = [t for mapping in (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_MAPPING_NAMES,
                               auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)
             for t, name in mapping.items() if name == arch]
    if not types:
        raise FamilyModelError(f"transformers has no causal LM or base model {arch}")
    # a multimodal model's causal LM is listed under its text config too (qwen3_5 and qwen3_5_text): the text one
    return next((t for t in types if t.endswith("_text")), types[0])


def make_default_model_as(quant: str, out_dir: Path) -> Path:
    """The default model (SmolLM2-135M) as a user's `quant` file (q4_k_m, q6_k, f16, ...): its HF folder converted to
    f16 by llama.cpp's converter, then quantized by llama.cpp's quantizer with its defaults, as a GGUF repository makes
    it (conftest.model_in requantizes the embedded Q4_1 instead). Made once, then cached in out_dir. The file the
    README's Q4_K_M figures against llama-server were taken on:
        .venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); import families; \
            print(families.make_default_model_as('q4_k_m', 'models/bench'))"
    """
    return _made_once(Path(out_dir), "SmolLM2-135M-Instruct", quant, _smollm_tokenizer_dir)


def _smollm_tokenizer_dir() -> Path:
    """The default model's HF folder (its tokenizer.json is SmolLM2's), made as the tests make it."""
    folder = REPO / "models" / "SmolLM2-135M-Instruct.q4_0.hf"
    if (folder / "tokenizer.json").is_file():
        return folder
    from syshaxd.sdk.gguf.quantize import ensure_quantized
    from syshaxd.sdk.hf_model import ensure_hf_folder
    from syshaxd.model import prepare_default_model

    models = REPO / "models"
    return ensure_hf_folder(ensure_quantized(prepare_default_model(models), "q4_0", models))


def _make_tokenizer(spec: Tokenizer, src: Path, out: Path):
    from transformers import AddedToken, AutoTokenizer

    if spec.kind == "bpe":
        tok = AutoTokenizer.from_pretrained(_smollm_tokenizer_dir())
        if spec.special:
            tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in spec.special], special_tokens=True)
        if spec.added:
            tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.added])
    elif spec.kind == "wordpiece":
        from tokenizers import BertWordPieceTokenizer
        from transformers import BertTokenizer

        trainer = BertWordPieceTokenizer(lowercase=True)
        # without sentencepiece's "\u2581" (some templates hold it): the converter writes a word's first piece as
        # "\u2581piece" and a continuation "##piece" as "piece", so a vocabulary holding "\u2581" itself would give
        # two tokens one text, which llama.cpp refuses (id_to_token.size() == token_to_id.size()); real BERT
        # vocabularies have no such token
        corpus = [line.replace("\u2581", " ") for line in _spm_corpus(src)]
        trainer.train_from_iterator(corpus, vocab_size=spec.vocab_size, min_frequency=1, show_progress=False,
                                    special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
        tok = BertTokenizer(vocab=trainer.get_vocab(), do_lower_case=True)
    elif spec.kind == "spm":
        (out / "tokenizer.model").write_bytes(_train_spm(spec, src))
        # the sentencepiece model's own special pieces; the roles are set below, once the added tokens exist
        unk, bos, eos, _ = spec.pieces
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": spec.hf_class, "unk_token": unk, "bos_token": bos, "eos_token": eos,
             "add_bos_token": True, "add_eos_token": False, "legacy": spec.legacy}))
        tok = AutoTokenizer.from_pretrained(out)
        if spec.added:
            tok.add_tokens([AddedToken(t, special=True, normalized=False, rstrip=t in spec.rstrip) for t in spec.added],
                           special_tokens=True)
    else:
        raise ValueError(spec.kind)
    for role in ("bos", "eos", "pad"):
        name = getattr(spec, role)
        if name:
            setattr(tok, f"{role}_token", name)
    return tok


def _spm_corpus(src: Path) -> list[str]:
    """Text of the pinned llama.cpp source: the same lines on every machine, so the same vocabulary."""
    files = sorted((src / "models" / "templates").glob("*.jinja")) + sorted((src / "conversion").glob("*.py"))
    files += [src / "gguf-py" / "README.md", src / "LICENSE"]
    lines = []
    for f in files:
        lines += [line for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    return lines


def _train_spm(spec: Tokenizer, src: Path) -> bytes:
    import sentencepiece as spm

    unk_id, bos_id, eos_id, pad_id = spec.ids
    unk, bos, eos, pad = spec.pieces
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_spm_corpus(src)), model_writer=model, model_type="bpe",
        vocab_size=spec.vocab_size, byte_fallback=True, character_coverage=1.0, split_digits=True,
        normalization_rule_name="identity", add_dummy_prefix=spec.dummy_prefix, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, max_sentence_length=16384, num_threads=1, minloglevel=2,
        unk_id=unk_id, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id,
        unk_piece=unk, bos_piece=bos, eos_piece=eos, pad_piece=pad, control_symbols=list(spec.control),
    )
    return model.getvalue()


# The converter runs unchanged, under this start: its requirements pin transformers 4.57, which loads a folder's
# tokenizer.json as written; transformers 5 (the venv's) instead rebuilds the tokenizer of some model types
# (qwen2, phi3, ...: MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS) with that family's own pre-tokenizer, whatever the
# folder says. Our folders are written by transformers 5 itself, so they are right as they are: with the list
# emptied, AutoTokenizer reads them as 4.57 would (else qwen2's SmolLM2 vocab gets Qwen2's regex, a pre-tokenizer
# hash the converter does not know, and the conversion stops). A family whose vocabulary is made here and is no
# real model's (bert-embedding's WordPiece) has a hash no converter knows: its tokenizer_pre names the pre-tokenizer
# the converter would write for a real model of the family (bge's "bert-bge"; llama.cpp's WPM tokenizer reads none).
_CONVERTER_START = """
import os, runpy, sys
try:
    from transformers.models.auto import tokenization_auto
    tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.clear()
except (ImportError, AttributeError):
    pass
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(script)  # as `python convert_hf_to_gguf.py` has it: conversion/, models/
pre = os.environ.get("SYSHAX_TOKENIZER_PRE")
if pre:  # a vocabulary made here: its hash is no real model's, so the family names its pre-tokenizer
    from conversion import base

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return pre

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path(script, run_name="__main__")
"""


def _convert(hf: Path, target: Path, outtype: str, extra: tuple[str, ...] = (), tokenizer_pre: str = "") -> None:
    src = llama_source()
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    # PYTHONPATH: the sdist's gguf-py, not the venv's gguf (the converter also puts it first, unless NO_LOCAL_GGUF)
    env = {k: v for k, v in os.environ.items() if k not in ("NO_LOCAL_GGUF", "SYSHAX_TOKENIZER_PRE")}
    if tokenizer_pre:
        env["SYSHAX_TOKENIZER_PRE"] = tokenizer_pre
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src / "gguf-py"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-c", _CONVERTER_START, str(src / "convert_hf_to_gguf.py"), str(hf),
           "--outfile", str(tmp), "--outtype", outtype, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise FamilyModelError(f"convert_hf_to_gguf.py {hf.name} --outtype {outtype} failed "
                               f"(exit {done.returncode}):\n{tail}")
    os.replace(tmp, target)


def _llama_ftype(quant: str) -> int:
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant.upper()}", None)
    if ftype is None:
        raise ValueError(f"llama.cpp has no file type {quant!r} (LLAMA_FTYPE_MOSTLY_{quant.upper()})")
    return ftype


def _quantize(source: Path, target: Path, quant: str, q8_output: bool = False) -> None:
    """q8_output: the output matrix and the token embeddings in q8_0, as syshaxd quantizes a model."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = _llama_ftype(quant)
    if q8_output:
        from syshaxd.sdk.gguf.quantize import GGML_TYPE_Q8_0

        params.output_tensor_type = params.token_embedding_type = GGML_TYPE_Q8_0
    params.nthread = len(os.sched_getaffinity(0))
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    # llama.cpp logs every tensor to stderr (fd 2): kept aside, and shown only if it fails
    with tempfile.TemporaryFile() as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        if rc != 0 or not tmp.is_file():
            tmp.unlink(missing_ok=True)
            log.seek(0)
            tail = "\n".join(log.read().decode(errors="replace").strip().splitlines()[-15:])
            raise FamilyModelError(f"llama.cpp could not quantize {source.name} to {quant} (error {rc}):\n{tail}")
    os.replace(tmp, target)


if __name__ == "__main__":  # python tests/families.py FAMILY OUT_DIR [QUANT]: one model, timed
    t0 = time.monotonic()
    print(make_family_model(sys.argv[1], Path(sys.argv[2]), *(sys.argv[3:4] or ["f16"])),
          f"{time.monotonic() - t0:.1f}s")
