"""A small random vision-language model, built offline, that vLLM's CPU build serves.

Idefics3 (a SigLIP-like vision tower, pixel-shuffle connector, and the tiny Llama of `tiny_llama`): LLaVA, PaliGemma
and most other vLLM VLMs import `transformers.models.pixtral.image_processing_pixtral`, which needs `torchvision`
(removed from this venv), while Idefics3's path in vLLM does not. vLLM's output for it equals transformers' to ~1e-5.

One `<image>` token in a request's `prompt_token_ids` becomes `PLACEHOLDER_IDS` (19 tokens:
`<fake_token_around_image> <global-img> <image>*16 <fake_token_around_image>`), and the scheduler's
`Request.mm_features[0]` is `identifier` = a blake3 hex of (model path, image bytes), `mm_position.offset` = the
`<image>` token's index, `length` 19, `is_embed` true for the 16 `<image>`s. One KV cache group (full attention).
vLLM's processor needs the tokenizer: the engine args must not skip it (`ENGINE_ARGS`).
"""

from __future__ import annotations

from typing import Any

VOCAB = 2048
IMAGE_SIZE = 64  # pixels a side; images of other sizes are resized to it
IMAGE_SEQ_LEN = 16  # (64 / patch 8)^2 patches / scale_factor^2
BOS, EOS, PAD, IMAGE, FAKE, GLOBAL = 1, 2, 3, 4, 5, 6
PLACEHOLDER_IDS = [FAKE, GLOBAL] + [IMAGE] * IMAGE_SEQ_LEN + [FAKE]
_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<image>", "<fake_token_around_image>", "<global-img>",
             "<end_of_utterance>"] + [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
FIRST_WORD_ID = len(_SPECIALS) + 1  # token i >= FIRST_WORD_ID is the word f"w{i}" (the one before is "\n")
ENGINE_ARGS: dict[str, Any] = {"skip_tokenizer_init": False, "limit_mm_per_prompt": {"image": 1}}


def make_vlm(path: str, seed: int = 0) -> dict:
    """Save the model (float32 safetensors), its processor and a WordLevel tokenizer in `path`; return what a test
    needs to build requests: `{"prompt_token_ids": ids_with_one_IMAGE, "multi_modal_data": {"image": pil}}`, or a
    text prompt like `"w100 <image> w101"` (a BOS is prepended to text prompts)."""
    import torch
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
        PreTrainedTokenizerFast,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    vocab = {t: i for i, t in enumerate([*_SPECIALS, "\n"])}
    vocab |= {f"w{i}": i for i in range(FIRST_WORD_ID, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>")

    torch.manual_seed(seed)
    vision = Idefics3VisionConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=IMAGE_SIZE, patch_size=8, initializer_range=0.02)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                       initializer_range=0.02, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    cfg = Idefics3Config(vision_config=vision, text_config=text, image_token_id=IMAGE, scale_factor=2,
                         pad_token_id=PAD, torch_dtype="float32")
    cfg.initializer_range = 0.02
    Idefics3ForConditionalGeneration(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": IMAGE_SIZE},
                                       max_image_size={"longest_edge": IMAGE_SIZE})
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_SEQ_LEN,
                      chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}").save_pretrained(path)
    return {
        "model": path,
        "image_token_id": IMAGE,
        "image_size": IMAGE_SIZE,
        "placeholder_ids": list(PLACEHOLDER_IDS),  # what one IMAGE token becomes in the engine's prompt
        "placeholder_tokens": len(PLACEHOLDER_IDS),  # mm_position.length
        "image_embed_tokens": IMAGE_SEQ_LEN,  # of those, the ones the vision tower fills (is_embed)
        "bos_token_id": BOS,
        "first_word_id": FIRST_WORD_ID,
        "vocab_size": VOCAB,
        "engine_args": dict(ENGINE_ARGS),
    }


def make_image(seed: int, size: int = IMAGE_SIZE):
    """An RGB noise image (PIL), the same for the same seed."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))
