"""A miniature of Kimi-K2.5's hub layout: a multimodal wrapper whose `language_model` attribute is
the DeepSeek-V3 causal LM. tiny_targets.py copies this file into the saved checkpoint as
`modeling_mini_kimi.py` and points config.json's `auto_map` at it, so transformers loads the
wrapper offline with `trust_remote_code=True`, as it loads Kimi-K2.5's own remote code.

What matters for this lab is the layout, not vision: like `KimiK25ForConditionalGeneration`,

    MiniKimiForConditionalGeneration
      .vision_tower      a stand-in vision encoder (one Linear; never used on text input)
      .mm_projector      a stand-in projector (one Linear)
      .language_model    DeepseekV3ForCausalLM (model.layers, model.norm, lm_head)

its forward returns the causal LM's output (logits [B, T, V]), and the inherited `get_decoder()`
returns `language_model` -- the causal LM, not its base decoder. Weight names carry the prefix
`language_model.` (e.g. `language_model.model.layers.0.self_attn.q_a_proj.weight`).

Self-contained: it imports transformers only (a remote-code file cannot import eagle3lib).
"""
from __future__ import annotations

from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PretrainedConfig, PreTrainedModel


class MiniKimiConfig(PretrainedConfig):
    model_type = "mini_kimi_vl"
    sub_configs = {"text_config": DeepseekV3Config}

    def __init__(self, text_config=None, vision_hidden_size: int = 32, **kwargs):
        if isinstance(text_config, dict):
            text_config = DeepseekV3Config(**text_config)
        self.text_config = text_config if text_config is not None else DeepseekV3Config()
        self.vision_hidden_size = vision_hidden_size
        super().__init__(**kwargs)


class MiniKimiForConditionalGeneration(PreTrainedModel):
    config_class = MiniKimiConfig
    base_model_prefix = ""
    _no_split_modules = ["DeepseekV3DecoderLayer"]
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]

    def __init__(self, config: MiniKimiConfig):
        super().__init__(config)
        text = config.text_config
        self.vision_tower = nn.Linear(config.vision_hidden_size, config.vision_hidden_size, bias=False)
        self.mm_projector = nn.Linear(config.vision_hidden_size, text.hidden_size, bias=False)
        self.language_model = DeepseekV3ForCausalLM(text)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def forward(self, input_ids=None, attention_mask=None, pixel_values=None, **kwargs):
        """Text only: image inputs are not part of this miniature (pixel_values must be None)."""
        if pixel_values is not None:
            raise NotImplementedError("MiniKimi is a text-only miniature of Kimi-K2.5's layout")
        return self.language_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
