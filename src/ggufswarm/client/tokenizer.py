"""Text in and out: llama.cpp tokenization, GGUF chat templates, streamed detokenization with stop strings."""

from __future__ import annotations

import codecs
import contextlib
import datetime
import json
import os
import re
from typing import Any

import jinja2
import jinja2.sandbox

# llama.cpp's built-in template used when a GGUF carries no tokenizer.chat_template
# (llama.cpp's common chat code falls back to chatml the same way).
BUILTIN_CHAT_TEMPLATES = {"gemma3": "gemma"}

USER_DEFINED = 4  # tokenizer.ggml.token_type of a user-defined token (llama.cpp's LLAMA_TOKEN_TYPE_USER_DEFINED)
# A user-defined token naming a media embedding's place: <start_of_image>, <end_of_image>, [multimodal] (Gemma 3),
# <|vision_start|>, <image_soft_token> ... (llama.cpp prints user-defined tokens as text; Hugging Face marks these
# special, so its skip_special_tokens drops them)
MEDIA_MARKER = re.compile(r"<\|?[a-z_]*(image|audio|video|vision|multimodal)[a-z_]*\|?>|\[multimodal\]")


def media_marker_ids(metadata: dict[str, Any]) -> frozenset[int]:
    """Ids of the user-defined tokens of a GGUF's vocabulary (``tokenizer.ggml.tokens`` / ``token_type``) that mark
    where an image, audio or video embedding goes (Gemma 3's ``<start_of_image>``). A text-only route can never
    follow one with media: like control tokens they are no text to show (``Tokenizer.token_bytes``)."""
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    types = metadata.get("tokenizer.ggml.token_type") or []
    return frozenset(
        i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == USER_DEFINED and MEDIA_MARKER.fullmatch(t)
    )


@contextlib.contextmanager
def _quiet_stderr():
    """Silence llama.cpp's logging (C-level fd 2 and the Python log callback) while loading a vocabulary."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def render_builtin_template(name: str, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """Render ``messages`` with llama.cpp's built-in chat template ``name`` (``llama_chat_apply_template``)."""
    import ctypes

    import llama_cpp

    chat = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages]
    )
    size = 256 + 2 * sum(len(m["content"].encode()) + len(m["role"]) for m in messages)
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(messages), add_generation_prompt, buf, size)
        if n < 0:
            raise ValueError(f"llama.cpp could not apply chat template {name!r}")
        if n <= size:
            return buf.raw[:n].decode("utf-8")
        size = n
    raise ValueError("chat template output did not fit")


class Tokenizer:
    """The model's vocabulary as llama.cpp reads it (``llama_cpp.Llama(path, vocab_only=True)``).

    ``encode`` adds BOS when ``tokenizer.ggml.add_bos_token`` says so, never twice;
    ``eog_ids`` is llama.cpp's set of end-of-generation tokens (``llama_vocab_is_eog``); ``has_fim``: the
    vocabulary has fill-in-the-middle tokens.
    """

    def __init__(self, model_path: str, metadata: dict[str, Any]):
        import llama_cpp  # deferred: loading the shared library takes a noticeable part of a second

        with _quiet_stderr():
            self._llm = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)
        self.metadata = metadata
        self.n_vocab = self._llm.n_vocab()
        self.bos_id = self._llm.token_bos()
        self.eos_id = self._llm.token_eos()
        self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", self.bos_id >= 0))
        vocab = llama_cpp.llama_model_get_vocab(self._llm.model)
        self.eog_ids = frozenset(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t))
        # fill-in-the-middle prefix / suffix / middle tokens (llama_vocab_fim_*), all three or none
        self.has_fim = all(
            f(vocab) >= 0
            for f in (llama_cpp.llama_vocab_fim_pre, llama_cpp.llama_vocab_fim_suf, llama_cpp.llama_vocab_fim_mid)
        )
        tokens = metadata.get("tokenizer.ggml.tokens") or []
        self.bos_token = tokens[self.bos_id] if 0 <= self.bos_id < len(tokens) else ""
        self.eos_token = tokens[self.eos_id] if 0 <= self.eos_id < len(tokens) else ""
        self.media_marker_ids = media_marker_ids(metadata)
        self.chat_template = metadata.get("tokenizer.chat_template")
        self.builtin_template = BUILTIN_CHAT_TEMPLATES.get(metadata.get("general.architecture"), "chatml")

    def grammar_parses(self, grammar: str) -> bool:
        """Whether llama.cpp's GBNF parser takes ``grammar`` (root rule ``root``) over this vocabulary: what a head's
        grammar sampler will be built from (its parse errors on stderr are silenced)."""
        import llama_cpp

        with _quiet_stderr():
            sampler = llama_cpp.llama_sampler_init_grammar(
                llama_cpp.llama_model_get_vocab(self._llm.model), grammar.encode(), b"root"
            )
        if not sampler:
            return False
        llama_cpp.llama_sampler_free(sampler)
        return True

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of ``text``; ``special`` parses control tokens such as ``<start_of_turn>``.

        BOS is prepended when ``add_bos`` (default: the GGUF's add_bos_token) and the text does not
        already start with it, so a template that writes ``<bos>`` itself does not double it.
        """
        add = self.add_bos if add_bos is None else add_bos
        ids = self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
        if add and self.bos_id >= 0 and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """The bytes a token renders to. Without ``special``, control tokens (``<eos>``, ``<start_of_turn>``: as
        llama.cpp's ``llama_token_to_piece``) and media markers (``media_marker_ids``) render to nothing; with it,
        to their text."""
        if not special and token_id in self.media_marker_ids:
            return b""
        return self._llm.detokenize([token_id], special=special)

    def decode(self, ids: list[int], special: bool = False) -> str:
        """Text of a token sequence (invalid UTF-8 replaced); ``special`` as ``token_bytes``."""
        return b"".join(self.token_bytes(t, special) for t in ids).decode("utf-8", errors="replace")

    @property
    def control_pattern(self) -> re.Pattern | None:
        """A regex matching the text of any control token (``tokenizer.ggml.token_type`` 3: turn markers such
        as ``<start_of_turn>`` or ``<|im_start|>``), longest first; None when the vocabulary has none."""
        if not hasattr(self, "_control_rx"):
            tokens = self.metadata.get("tokenizer.ggml.tokens") or []
            types = self.metadata.get("tokenizer.ggml.token_type") or []
            control = sorted({t for t, ty in zip(tokens, types) if ty == 3 and t}, key=len, reverse=True)
            self._control_rx = re.compile("|".join(map(re.escape, control))) if control else None
        return self._control_rx

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of ``messages`` (and ``tools``, see ``render_chat``) rendered with the chat template, where
        only the template writes control tokens: text in a message that looks like one (``<|im_end|>``,
        ``<start_of_turn>``) is tokenized as the literal text it is, so a message cannot forge a turn. The same
        holds for every other string a client sends: tool definitions, tool call names and arguments, names.

        Messages without such text give exactly ``encode(render_chat(messages, tools=tools))``. Otherwise the
        template is rendered with a placeholder per message to find where each message's text lands, the
        template's parts are tokenized with control tokens and the messages' without; control-token text in
        the other strings is replaced by an ASCII placeholder before rendering (it survives JSON escaping) and
        tokenized as literal text where the placeholder lands. ValueError when the template rejects the
        messages, or transforms a message holding control-token text beyond recognition.
        """
        rx = self.control_pattern
        if rx is None:
            return self.encode(self.render_chat(messages, add_generation_prompt, tools))
        nonce = os.urandom(4).hex()
        literal: dict[str, str] = {}  # placeholder -> control-token text a client wrote outside message content

        def mask(value):
            if isinstance(value, str):

                def sub(m):
                    key = f"ggufswarmctl{nonce}n{len(literal)}x"
                    literal[key] = m.group()
                    return key

                return rx.sub(sub, value)
            if isinstance(value, dict):
                return {mask(k): mask(v) for k, v in value.items()}
            if isinstance(value, list):
                return [mask(v) for v in value]
            return value

        messages = [{k: (v if k == "content" else mask(v)) for k, v in m.items()} for m in messages]
        tools = mask(tools)
        rendered = self.render_chat(messages, add_generation_prompt, tools)
        if not literal and not any(rx.search(m.get("content") or "") for m in messages):
            return self.encode(rendered)
        marks = [f"@@ggufswarm-message-{i}-{nonce}@@" for i in range(len(messages))]
        # (an empty content stays empty: templates test it, e.g. an assistant turn with only tool calls)
        skeleton = self.render_chat(
            [{**m, "content": mark} if m.get("content") else m for m, mark in zip(messages, marks)],
            add_generation_prompt,
            tools,
        )
        parts = re.split("(" + "|".join(map(re.escape, marks)) + ")", skeleton)
        pieces, rebuilt = [], ""
        for i, part in enumerate(parts):
            if i % 2 == 0:
                pieces.append((part, True))
                rebuilt += part
                continue
            text = messages[marks.index(part)].get("content") or ""
            for candidate in (text, text.strip()):  # as given, or as a template that trims it writes it
                if rendered.startswith(rebuilt + candidate):
                    break
            else:
                raise ValueError(
                    "a message holds control-token text and the chat template rewrites messages, so "
                    "it cannot be sent as literal text"
                )
            pieces.append((candidate, False))
            rebuilt += candidate
        if rebuilt != rendered:
            raise ValueError(
                "a message holds control-token text and the chat template renders messages in a way "
                "that cannot be split safely"
            )
        if literal:  # the template's parts: placeholders of control-token text a client wrote become that text
            split = re.compile("(" + "|".join(map(re.escape, literal)) + ")")
            pieces = [
                (p if j % 2 == 0 else literal[p], special and j % 2 == 0)
                for text, special in pieces
                for j, p in enumerate(split.split(text) if special else [text])
            ]
            if any(key in text for text, _ in pieces for key in literal):
                raise ValueError(
                    "the chat template rewrites tool definitions or calls holding control-token text, "
                    "so they cannot be sent as literal text"
                )
        ids: list[int] = []
        for text, template in pieces:
            if text:
                ids += self.encode(text, add_bos=False, special=template)
        if self.add_bos and self.bos_id >= 0 and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """Render ``messages`` (``[{"role", "content", ...}]``; an assistant turn may carry ``tool_calls``
        ``[{"id", "type": "function", "function": {"name", "arguments"}}]``, a ``tool`` turn ``tool_call_id`` and
        ``name``) with the GGUF's ``tokenizer.chat_template`` (jinja2), as Hugging Face's ``apply_chat_template``
        does: ``tools`` (OpenAI's ``[{"type": "function", "function": {"name", "description", "parameters"}}]``)
        is the template's ``tools`` variable (None when not given), and ``tojson`` writes JSON as Python's
        ``json.dumps(ensure_ascii=False)`` (not jinja2's HTML-escaping one).

        A GGUF without a template gets llama.cpp's built-in one for its family (``gemma`` for gemma3,
        else ``chatml``), which renders no tools (ValueError with tools). Raises ValueError when the template
        rejects the messages.
        """
        if not self.chat_template:
            if tools:
                raise ValueError("llama.cpp's built-in chat template renders no tools")
            return render_builtin_template(self.builtin_template, messages, add_generation_prompt)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str):
            raise ValueError(f"chat template: {message}")

        def tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
            return json.dumps(
                value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
            )

        env.filters["tojson"] = tojson
        env.globals.update(
            raise_exception=raise_exception, strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt)
        )
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools or None,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc


class TextStream:
    """Turns generated token ids into text deltas safe to show.

    Never splits a multi-byte UTF-8 character (incremental decoder), never emits any part of a
    stop string (text that could still become one is held back), and stops at end-of-generation
    tokens. ``push`` returns the newly safe text; ``finish`` returns what is left to flush.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None, special: bool = False):
        self.tokenizer = tokenizer
        self.special = special  # control tokens and media markers as text (Tokenizer.token_bytes)
        self.stop = [s for s in (stop or []) if s]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self.stopped = False
        self.finish_reason: str | None = None

    def push(self, token_id: int) -> str:
        """Feed one generated token id; returns text to emit (possibly ``""``)."""
        if self.stopped:
            return ""
        if token_id in self.tokenizer.eog_ids:
            self.stopped, self.finish_reason = True, "stop"
            return self._flush_pending()
        self._pending += self._decoder.decode(self.tokenizer.token_bytes(token_id, self.special))
        for s in self.stop:
            idx = self._pending.find(s)
            if idx >= 0:
                self.stopped, self.finish_reason = True, "stop"
                out, self._pending = self._pending[:idx], ""
                return out
        hold = max((n for s in self.stop for n in range(1, len(s)) if self._pending.endswith(s[:n])), default=0)
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(out) :]
        return out

    def _flush_pending(self) -> str:
        out, self._pending = self._pending + self._decoder.decode(b"", final=True), ""
        return out

    def finish(self, reason: str = "length") -> str:
        """End of generation: flush held-back text (it was not a stop string after all)."""
        if self.finish_reason is None:
            self.finish_reason = reason
        return "" if self.stopped else self._flush_pending()
