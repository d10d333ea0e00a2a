"""The presets' tokenizer: a deterministic byte-level BPE trained on a small original corpus,
its special tokens, and their ChatML chat template."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

if TYPE_CHECKING:
    from pdcluster.engine.presets import Preset

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<image>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, IMAGE_TOKEN_ID, IM_START_ID, IM_END_ID = range(6)

# Training text for the built-in tokenizer. Original prose, so that common English words merge.
_CORPUS = """\
The morning fog rolled slowly over the hills, and the small town woke up one window at a time.
A baker opened her shop before sunrise; the smell of fresh bread drifted down the quiet street.
Children walked to school in pairs, talking about games, homework, and the weekend ahead.
Nobody noticed the old clock on the tower had stopped at a quarter past seven.
When the train arrived, travelers stepped onto the platform carrying bags, maps, and umbrellas.
Some were visiting family; others had come for work, and a few simply wanted to see the sea.
The river runs through the center of the city, under seven bridges built in different centuries.
In spring the banks are covered with yellow flowers, and in winter the water sometimes freezes.
Computers process information by following instructions written as programs.
A program reads input, performs calculations, stores results in memory, and produces output.
Modern processors contain billions of transistors that switch on and off many times per second.
Software engineers design systems, write code, test it carefully, and fix the bugs they find.
A good system is simple to understand, easy to change, and fast enough for its users.
Networks connect machines across rooms, buildings, countries, and even the bottom of the ocean.
Data travels in small packets; each packet knows its destination and finds its own way there.
When a server receives a request, it sends back a response with a status code and a body.
Large language models predict the next word in a sentence, one token after another.
They are trained on huge amounts of text and learn patterns of grammar, facts, and style.
Serving such a model means managing memory for the cache of keys and values of every request.
Prefill processes the whole prompt at once, while decode produces new tokens step by step.
Separating the two phases lets each machine do the work it is best at.
To cook a simple soup, chop an onion, two carrots, and a potato into small pieces.
Warm some oil in a pot, add the onion, and stir until it turns soft and golden.
Add the other vegetables, pour in water or stock, and season with salt and pepper.
Let it simmer for twenty minutes, then taste it and serve it hot with a slice of bread.
Scientists observe the natural world, ask questions, and test their ideas with experiments.
The sun is a star, one of many billions in our galaxy, and the earth travels around it once a year.
Light from the sun takes about eight minutes to reach us, crossing an enormous distance.
Plants use that light to turn water and carbon dioxide into sugar and oxygen.
Animals eat the plants, and other animals eat them, forming long chains of life.
"Where are you going?" asked the fisherman, pulling his boat onto the sand.
"To the mountains," said the young woman. "I want to see the snow before it melts."
He laughed and pointed north. "Follow the road past the farm, then turn left at the old mill."
She thanked him, lifted her pack, and started walking as the wind picked up from the west.
History is full of surprising turns: small decisions that changed the lives of millions.
Libraries keep the memory of those moments in books, letters, photographs, and recordings.
Reading about the past helps us understand the present and imagine a better future.
Music can make people feel happy, calm, or sad within a few notes.
A song usually has verses and a chorus; the melody repeats so that listeners can sing along.
Musicians practice for years to play their instruments with skill and feeling.
The weather today is cloudy with a chance of rain in the afternoon and a light breeze.
Tomorrow will be warmer and sunny, with temperatures rising to twenty four degrees.
Please remember to bring a jacket if you plan to stay outside after dark.
Numbers are everywhere: 1, 2, 3, 10, 42, 100, 365, 1000, 2024, and 3.14159.
The meeting starts at 9:30 and ends at 11:00; lunch is served from 12:15 until 13:45.
Questions? Answers! Lists, dates, prices like $19.99 or 5%, and emails like team@example.com.
Thank you for reading. If you have questions, feedback, or ideas, please let us know.
The cat slept on the warm windowsill while rain tapped gently against the glass.
Later it woke, stretched its legs, and walked into the kitchen looking for something to eat.
Every language has its own rules, yet people everywhere tell stories, jokes, and secrets.
Learning a new language opens doors to new friends, new books, and new ways of thinking.
Teachers explain difficult ideas with examples, pictures, and patient repetition.
Students ask questions, make mistakes, and slowly become confident and independent.
The market was crowded with people buying apples, oranges, cheese, fish, and fresh herbs.
Sellers called out their prices, and the air was full of voices, colors, and smells.
An image is a grid of pixels; each pixel has a red, a green, and a blue value.
A vision encoder turns the picture into a sequence of vectors the language model can read.
The assistant looked at the photo and described a dog running across a green field.
Hello! How can I help you today? I can answer questions, summarize text, or write a poem.
Sure, here is a short summary of the article you shared, followed by three key points.
First, the results were better than expected. Second, the costs were lower. Third, it scales.
Finally, remember that simple tools, used well, can solve surprisingly hard problems.
"""


def _corpus_lines() -> list[str]:
    lines = _CORPUS.splitlines()
    # Lower- and upper-case copies so that capitalized and shouted words merge too.
    return lines + [line.lower() for line in lines] + [line.upper() for line in lines[:10]]


# The pre-tokenizer split of Qwen2's tokenizer.json (digits one by one, letters grouped);
# transformers rebuilds a qwen2 tokenizer with exactly this pipeline, so ours must match it.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_tokenizer(preset: Preset) -> Tokenizer:
    """A deterministic byte-level BPE tokenizer; any UTF-8 text round-trips through it."""
    tokenizer = Tokenizer(models.BPE())
    if preset.model_type == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=preset.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer)
    if preset.add_bos_token:
        bos = SPECIAL_TOKENS[BOS_TOKEN_ID]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_TOKEN_ID)]
        )
    return tokenizer


def chat_template(allow_images: bool, add_bos: bool, tools: bool = False) -> str:
    """ChatML. Rendered with trim_blocks/lstrip_blocks, as transformers does (so every newline
    after a block tag is written as an expression). With `tools`, as Qwen2.5 renders them:
    the functions in the system turn, an assistant's calls as `<tool_call>` blocks of JSON
    (the Hermes format), a tool's answer as a `<tool_response>` in a user turn."""
    image = (
        "<image>" if allow_images else "{{ raise_exception('this model does not take images') }}"
    )
    content = (
        "{% macro content(c) %}{% if c is string %}{{ c }}"
        "{% elif c is not none %}{% for part in c %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] in ['image', 'image_url', 'input_image'] %}" + image + "{% else %}"
        "{{ raise_exception('unsupported content part type: ' + part['type']) }}"
        "{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    )
    bos = "{{ bos_token }}" if add_bos else ""
    turns = (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}{{ content(message['content']) }}"
        "{{ '<|im_end|>\\n' }}{% endfor %}"
    )
    if tools:
        turns = (
            "{% if tools %}{{ '<|im_start|>system\\n' }}"
            "{% if messages[0]['role'] == 'system' %}"
            "{{ content(messages[0]['content']) + '\\n\\n' }}{% endif %}"
            "{{ 'You can call these functions, given as JSON schemas:\\n<tools>\\n' }}"
            "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
            '{{ \'</tools>\\nTo call one, answer with <tool_call>\\n{"name": <name>, '
            '"arguments": <arguments>}\\n</tool_call>.<|im_end|>\\n\' }}{% endif %}'
            "{% for message in messages %}"
            "{% if tools and loop.first and message['role'] == 'system' %}"
            "{% elif message['role'] == 'tool' %}"
            "{{ '<|im_start|>user\\n<tool_response>\\n' }}{{ content(message['content']) }}"
            "{{ '\\n</tool_response><|im_end|>\\n' }}"
            "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
            "{{ content(message['content']) }}"
            "{% for call in message['tool_calls'] or [] %}"
            "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
            "{{ '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", "
            "\"arguments\": ' }}{{ call['function']['arguments'] | tojson }}"
            "{{ '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        )
    return (
        content + bos + turns
        + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )  # fmt: skip
