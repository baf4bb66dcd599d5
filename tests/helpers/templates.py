"""Tokenizers and chat templates other than the shipped ones: a small BPE tokenizer with a template
that is not ChatML, and a Qwen3-like ChatML template that is not prefix-stable."""

from pathlib import Path


ALT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ '<s>Bot: ' + m['content'] + '</s>\n' }}"
    "{% else %}{{ '<s>' + m['role'] + ': ' + m['content'] + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<s>Bot: ' }}{% endif %}"
)


def make_alt_tokenizer(directory: Path, template: str = ALT_TEMPLATE):
    """A different HF tokenizer: other special tokens, vocab 300, a non-ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["user: what is two plus three", "Bot: five", "system: be brief"] * 10, trainer=trainer)
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", chat_template=template
    )
    hf.save_pretrained(str(directory))
    return directory


# A second template, Qwen3-like and not prefix-stable: the generation prompt holds an empty think
# block, and assistant turns before the last user message lose their think block (and reasoning).
THINK_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' + (messages[0].content + '\\n\\n' if messages[0].role == 'system' else '')"
    " + '<tools>' }}{%- for t in tools %}{{ '\\n' + (t | tojson) }}{%- endfor %}{{ '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{ '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user %}{{ '<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}{{ '<tool_call>' + ({'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson) + '</tool_call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{ '<|im_start|>tool\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
