"""A BERT cross-encoder's logits with its last layer run for the first token only.

A sequence classifier reads one vector: the last layer's output at ``[CLS]`` (BERT's pooler takes
``hidden[:, 0]``). Every other position of the last layer is computed and thrown away. Here the last
layer's keys and values still come from every token, since ``[CLS]`` attends to all of them, but its
query, attention output and feed-forward block run on one position instead of all: of a 6-layer
MiniLM's work at 96 tokens, ~14% is never done. The arithmetic for ``[CLS]`` is the model's own,
module by module, so the logits are the full model's up to the rounding of a matrix product over
fewer rows (tests hold them together).
"""

from __future__ import annotations

import torch


class FirstTokenLogits(torch.nn.Module):
    """``BertForSequenceClassification``'s logits, the last layer computed for ``[CLS]`` only."""

    def __init__(self, model) -> None:
        super().__init__()
        bert = model.bert
        self.embeddings, self.layers = bert.embeddings, bert.encoder.layer
        self.pooler, self.classifier = bert.pooler, model.classifier

    @classmethod
    def of(cls, model) -> FirstTokenLogits | None:
        """The pass for ``model``, or None for a model it does not know (any other architecture, a
        decoder, a model without a pooler): that one runs whole."""
        config = model.config
        if (
            getattr(config, "model_type", None) != "bert"
            or config.is_decoder
            or getattr(model, "bert", None) is None
            or model.bert.pooler is None
            or not hasattr(model, "classifier")
        ):
            return None
        return cls(model).eval()  # a new module starts in training mode; its exporter restores that mode

    def head_in_fp32(self) -> None:
        """Pooler and classifier (a few thousand weights) in fp32 under a bf16 body: a bf16 logit is
        rounded to ~0.03 at the scores' size, and close candidates would tie."""
        self.pooler.float()
        self.classifier.float()

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        # additive mask, as the eager and SDPA attentions take it: 0 where a token is, the dtype's
        # lowest value on padding
        mask = (1.0 - attention_mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
        for layer in self.layers[:-1]:
            hidden = layer(hidden, mask)
        last = self.layers[-1]
        attention = last.attention.self
        batch, length, _ = hidden.shape
        heads = (batch, -1, attention.num_attention_heads, attention.attention_head_size)
        first = hidden[:, :1]
        query = attention.query(first).view(*heads).transpose(1, 2)
        key = attention.key(hidden).view(*heads).transpose(1, 2)
        value = attention.value(hidden).view(*heads).transpose(1, 2)
        scaling = getattr(attention, "scaling", attention.attention_head_size**-0.5)  # transformers < 4.53 has none
        weights = torch.softmax(query @ key.transpose(2, 3) * scaling + mask, dim=-1)
        context = (weights @ value).transpose(1, 2).reshape(batch, 1, -1)
        attended = last.attention.output(context, first)
        out = last.output(last.intermediate(attended), attended)
        # the head in its own dtype (fp32 under a bf16 body: :meth:`head_in_fp32`)
        return self.classifier(self.pooler(out.to(self.pooler.dense.weight.dtype)))
