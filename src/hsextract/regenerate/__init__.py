"""Response regeneration: every assistant turn rewritten by the target model itself.

Drafters accept more when they are trained on what the target would say. This stage reads the input
conversations exactly as `prepare` does (same sources, same mixture order, same chunking over input
records: record k belongs to chunk k // prompts_per_chunk) and, turn by turn, replaces each assistant
message with the target's own generation:

  context of turn j = the conversation up to j, with the REGENERATED earlier assistant turns, rendered by
                      the same chat template with the same `chat_template_kwargs` as extraction
                      (add_generation_prompt=True) and tokenized without added special tokens, exactly as
                      `ChatMasker` tokenizes the full rendering later;
  generation        = sampled with the `regenerate` settings until the template's end-of-turn token (or
                      max_new_tokens); the end-of-turn token itself is not part of the message, the
                      template writes it back.

The generated ids are decoded and turned back into a message ({content} or {reasoning_content, content}
when the text holds a `</think>`). The split that the template renders back to exactly the prompt text +
the generated text is chosen; where no rendering can hold it (a template that cuts the reasoning from every
turn: DeepSeek-R1, QwQ), the split whose sample, as prepare makes it (`ChatMasker.turn_ids`), holds the
prompt + generated ids. `stats.roundtrip` counts turns whose re-tokenized rendering or sample holds exactly
the generated ids and the stop token the model wrote ("tokens"), a rendering only the same text ("text": the
text re-tokenizes to other ids, a sampled special or a split UTF-8 character, or the template writes another
end-of-turn than the one the model stopped with; prepare trains the rendering's ids), or neither ("none": e.g.
a template that trims content); a job with "text" or "none" turns says so in its log.

One output line per input record, so the regenerated file holds as many records as the input mixture and
`prepare` on it has the chunk count computed from the original sources:
  - regenerated conversation: {"id", "source", "messages", "tools"?}
  - a turn that produced no text (or hit max_new_tokens with `drop_truncated`), that ended (stopped or hit
    max_new_tokens) inside the reasoning block its generation prompt opened, or that opened a tool call the
    recorded turn did not make (`tool_call_opener`), or whose context already holds prepare's `max_seq_len`
    tokens (its sample could train nothing, and an engine may run out of memory on it): the conversation is
    cut before that turn; prepare then drops it if nothing is left to train (no_trained_tokens);
  - a malformed input record, or one whose context the chat template refuses (counted in `refused` by the
    reason prepare drops it under), in lenient mode: {"id", "source", "messages": [], "malformed": reason},
    which prepare counts under that reason; strict mode raises, naming the record's file:line.
Assistant turns with tool calls: `tool_turns: keep` leaves them as in the source (the target's own tool
calls would not match the recorded tool results), `truncate` ends the conversation before the first one.
A conversation that ends with a user or tool message gets a generated final assistant turn when
`complete_last_turn` is true (prompt-only datasets).

Sampling is deterministic: each (sample_id, turn) gets its own seed derived from `seed`, used by a
torch.Generator per sample (transformers) or sent as `sampling_seed` (sglang, whose server uses it only with
--enable-deterministic-inference: hsextract.sglang.generate checks), so the draws do not depend on which samples
share a batch. The logits can, in their last bits (a padded bfloat16 batch against one row), which may flip a
near tie: the same config, batch_size and CPU threads give the same file, another batch_size or thread count
may not (config/README.md).

Files: `run_regenerate_chunk` writes chunk-NNNNN.jsonl and chunk-NNNNN.stats.json (stats first, then the
JSONL, each to a temporary name + rename): a failed chunk leaves no JSONL and reruns alone.
`concat_chunks` joins the chunk files, in chunk order, into the conversation file `prepare` reads.

Settings: hsextract.config.settings, built once from the config (`from_config`): `Settings.regenerate` (the
`regenerate:` section, defaults and ranges in the config schema) and `Settings.prepare` (sources, seed,
prompts_per_chunk, strict, chat template).
"""

from hsextract.engines.base import Generator, cut_at_stop
from hsextract.regenerate.files import chunk_name, concat_chunks, stats_path
from hsextract.regenerate.regenerator import Regenerator, RegenStats, regenerate_chunk, sample_seed
from hsextract.regenerate.run import make_generator, run_regenerate_chunk
from hsextract.regenerate.template import end_of_turn_ids

__all__ = [
    "Generator", "RegenStats", "Regenerator", "chunk_name", "concat_chunks", "cut_at_stop", "end_of_turn_ids",
    "make_generator", "regenerate_chunk", "run_regenerate_chunk", "sample_seed", "stats_path",
]
