"""A toy causal LM whose logits are hand-computable: the hidden state at position t is row ids[t] of
`table` and the output head is the identity, so logits[t] = table[ids[t]]."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn


class ToyDecoder(nn.Module):
    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.embed = nn.Embedding.from_pretrained(table.clone(), freeze=False)

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(last_hidden_state=self.embed(input_ids))


class ToyLM(nn.Module):
    def __init__(self, table: torch.Tensor):
        super().__init__()
        v = table.shape[1]
        self.model = ToyDecoder(table)
        self.lm_head = nn.Linear(v, v, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.eye(v))
        self.config = SimpleNamespace()

    def get_decoder(self):
        return self.model

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0):
        hidden = self.model(input_ids, attention_mask).last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return SimpleNamespace(logits=self.lm_head(hidden))
