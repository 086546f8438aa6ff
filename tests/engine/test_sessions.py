"""Sessions persist token ids and block keys; turns are templated alone and appended."""

from __future__ import annotations

from pathlib import Path

from kvagentd.engine.model import LoadedModel
from kvagentd.engine.sessions import ChatFormat, Session, SessionStore, valid_session_id


def test_sessions_survive_reopen(tmp_path: Path) -> None:
    table = SessionStore(tmp_path)
    s = Session("pump-1", [1, 2, 3, 70000], [b"k" * 16, b"j" * 16], turns=2)
    table.save(s)
    s.token_ids.append(9)
    table.save(s)
    table.save(Session("other", [5]))
    table.close()
    again = SessionStore(tmp_path)
    got = again.get("pump-1")
    assert got is not None
    assert got.token_ids == [1, 2, 3, 70000, 9]
    assert got.block_keys == [b"k" * 16, b"j" * 16]
    assert got.turns == 2
    assert {x.id for x in again.list()} == {"pump-1", "other"}
    assert again.drop("other") is not None and again.drop("other") is None
    assert again.count() == 1
    assert again.get("nope") is None


def test_session_ids() -> None:
    assert valid_session_id("asset:pump-1@line.2")
    assert not valid_session_id("") and not valid_session_id("a/b")
    assert not valid_session_id("x" * 129)


def test_turns_are_appended_not_retemplated(tiny: LoadedModel) -> None:
    tok = tiny.tokenizer
    chat = ChatFormat(tok)
    a = chat.first_turn("You watch pumps.", "status?")
    b = chat.first_turn("You watch pumps.", "something else entirely")
    common = 0
    while a[common] == b[common]:
        common += 1
    sys_ids = chat.first_turn("You watch pumps.", "x")
    assert common >= len(tok("<|im_start|>system\nYou watch pumps.<|im_end|>\n",
                              add_special_tokens=False)["input_ids"])
    assert tok.decode(sys_ids).startswith("<|im_start|>system\nYou watch pumps.<|im_end|>")
    nxt = chat.next_turn("and now?")
    assert tok.decode(nxt) == "<|im_start|>user\nand now?<|im_end|>\n<|im_start|>assistant\n"
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(chat.close_turn([11, end])) == "\n"
    assert tok.decode(chat.close_turn([11, 12])) == "<|im_end|>\n"
    assert end in chat.stop_ids
    # a turn left unanswered: the prompt without its assistant header, as the template renders
    # the conversation up to the user's turn
    user = [{"role": "system", "content": "You watch pumps."}, {"role": "user", "content": "status?"}]
    assert tok.decode(chat.unanswered(a)) == tok.apply_chat_template(
        user, tokenize=False, add_generation_prompt=False)
    assert chat.unanswered(a) == a[:len(chat.unanswered(a))]
    bare = chat.unanswered(a)
    assert chat.unanswered(bare) == bare  # a session's own ids, continued: as they are
    # the template's own rendering of the whole conversation equals the appended ids' text
    hist = a + [28, 29] + chat.close_turn([28, 29]) + nxt
    msgs = [{"role": "system", "content": "You watch pumps."},
            {"role": "user", "content": "status?"},
            {"role": "assistant", "content": tok.decode([28, 29])},
            {"role": "user", "content": "and now?"}]
    assert tok.decode(hist) == tok.apply_chat_template(msgs, tokenize=False,
                                                       add_generation_prompt=True)
