"""Tokenizers and chat templates other than the shipped ones: a small BPE tokenizer with a template
that is not ChatML, ChatML that renders contents only, a Qwen3-like ChatML template that is not
prefix-stable and Qwen3's own."""

import copy
from pathlib import Path


ALT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ '<s>Bot: ' + m['content'] + '</s>\n' }}"
    "{% else %}{{ '<s>' + m['role'] + ': ' + m['content'] + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<s>Bot: ' }}{% endif %}"
)


def with_template(tokenizer, template: str):
    """A copy of ``tokenizer`` with another chat template."""
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


# ChatML that renders roles and contents only: no tools, tool calls or reasoning.
PLAIN_CHATML = ("{% for m in messages %}<|im_start|>{{m.role}}\n{{m.content}}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


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


# Qwen3's template (Qwen/Qwen3-8B), its rules written compactly, its tools preamble shortened:
# tools as JSON lines in the system turn; the last user query is the last user message that is not
# a wrapped tool response; an assistant turn after it keeps its think block (the last message
# always, others when they carry reasoning), earlier turns lose it; tool calls as JSON in
# <tool_call>; tool results in a user turn.
QWEN3_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}"
    "{%- endif %}{{- '# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and not (message.content.startswith('<tool_response>')"
    " and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}{%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set call = tool_call.function if tool_call.function else tool_call %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{{- call.arguments if call.arguments is string else (call.arguments | tojson) }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
