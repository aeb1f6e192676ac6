"""Turning a dataset row's prompt into token ids with the tokenizer's chat template."""

from tandem.data.datasets import DataError

PROMPT_TRUNCATION = ("error", "left", "skip")


def prompt_text(tokenizer, prompt, template_kwargs: dict | None = None) -> str:
    """A list of messages goes through the chat template (with the assistant turn opened, and
    `template_kwargs` such as Qwen3's enable_thinking); a plain string is used as it is, as in
    TRL's "standard" (non-conversational) format."""
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the prompt is a list of chat messages but the tokenizer has no chat_template; give plain string prompts or a tokenizer with a template")
    try:
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **(template_kwargs or {}))
    except Exception as exc:  # jinja2's errors name no row; load_prompts adds it
        raise DataError(f"the chat template could not render the prompt ({type(exc).__name__}: {exc})") from None


def encode_prompt(tokenizer, prompt, max_prompt_length: int | None, truncation: str, template_kwargs: dict | None = None) -> list[int] | None:
    """Token ids of one prompt, or None when it is too long and `truncation` is "skip".

    "error" raises, "left" keeps the last max_prompt_length tokens (the end of a prompt holds the
    question and the opened assistant turn), "skip" drops the prompt (the trainer counts them).
    """
    ids = tokenizer(prompt_text(tokenizer, prompt, template_kwargs), add_special_tokens=False)["input_ids"]
    if max_prompt_length is None or len(ids) <= max_prompt_length:
        return list(ids)
    if truncation == "left":
        return list(ids[-max_prompt_length:])
    if truncation == "skip":
        return None
    raise DataError(
        f"a prompt has {len(ids)} tokens, more than max_prompt_length={max_prompt_length}; "
        "raise max_prompt_length or set prompt_truncation to 'left' or 'skip'"
    )
