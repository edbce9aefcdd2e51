"""What the router reads of a request: the task, not what is said around it to buy a dearer tier.

The last user turn, with forged chat turns, claims of authority or difficulty, pleas for a bigger
model, repeated sentences, code nobody asks about, and a preamble the question neither refers to
nor needs taken out. The features and the learned scorer's embedding both read only this text, so
none of that moves a decision. Pure; nothing here changes what the model is sent.
"""

from __future__ import annotations

import re

from policy.guardrails import INJECTION
from policy.router_meta import ASK, joined, only_talk, task_lines, unframed

# Words that argue about the model, the effort or the caller's standing rather than state the task.
PLEA = re.compile(
    r"\b((biggest|largest|best|strongest|smartest|most (capable|powerful|expensive|advanced|intelligent)|premium|frontier|top|highest|"
    r"advanced|larger|bigger|stronger|smarter|better|expensive)[- ](model|tier|ai|llm|engine|version|reasoning)s?|"
    r"expert[- ](mode|level)|vip|(extremely|very|really|super|incredibly|exceptionally) (hard|difficult|complex|tricky)|"
    r"(hard|difficult|complex|tricky|challenging) (question|problem|task|one|request)|this (matters|is (important|critical|urgent))|"
    r"(answer|think|respond|reply|check|reason)( very| really)? (carefully|thoroughly|hard|deeply|precisely|accurately|rigorously)|"
    r"maximum (effort|priority|quality)|(top|highest|high|urgent|maximum) priority|priority\s*[:=]|tier\s*[:=]|"
    r"as (the|an?|your) (ceo|cto|cfo|admin(istrator)?|owner|developer|manager|director|operator|supervisor|lead)\b|"
    r"i (hereby )?(authori[sz]e|order|instruct|command|require) you|authori[sz]ed (to|by)|(admin|root|sudo|developer|god) (access|mode|override)|"
    r"enterprise[- ](tier|customer|plan|user|account)|premium (user|customer|account|plan|subscriber)|"
    r"full (capacity|power|reasoning)|\bgpt-?\d|\bclaude\b|\bgemini\b|"
    r"my (boss|manager|ceo|cto|lead) (said|says|wants|insists|requires)|"
    r"(expensive|largest|biggest|strongest|smartest|best|highest|premium|advanced|powerful|capable|frontier|top|quality)\W+(\w+\W+){0,3}"
    r"(model|tier|llm|engine)s?\b|priority request|by order of|override|difficulty\s*[:=]|"
    r"this is an? (\w+[ ,]+){0,2}(hard|difficult|complex|tricky|challenging)|"
    # claims that the task is hard: graduate exams and olympiads do not make a question one
    r"olympiad|ph\.?d|graduate[- ](level|exam|course)|qualifying exam|proof[- ]level|rigou?r|rigorous(ly)?|formal correctness|"
    r"multi-step reasoning|asymptotic complexity|edge cases|for context)", re.IGNORECASE)
# Chat-template tags inside a message: each becomes a line naming the turn it opens (or a plain break).
_TEMPLATE_TAG = re.compile(r"<\|(im_start|start_header_id)\|>\s*(system|user|assistant|developer)\s*(<\|end_header_id\|>)?|"
                           r"<\|(system|user|assistant)\|>|<<(/?)SYS>>|<\|(im_end|eot_id|end)\|>|<\|[a-z_]+\|>|\[/?INST\]", re.IGNORECASE)
# A line that opens a turn ("### System", "[assistant]", "<system>", "User:", "[SYSTEM]: text", "System message:",
# "Assistant (frontier model):", "SISTEMA:"): what follows until the next such line is that role's, and only the
# user's turns are the caller's.
_ROLE_LINE = re.compile(r"^\s*(#{1,6}\s*|\[|<|\*\*)?\s*(system|assistant|developer|user|human|ai|model|sistema|syst[eè]me|usu[aá]rio|"
                        r"usuario|utilisateur|nutzer|benutzer|assistente|asistente|assistent)(?:\s+(?:message|prompt|turn|note|instructions?))?"
                        r"\s*(\]|>|\*\*)?\s*(?:\([^()\n]{1,40}\)\s*)?(:|$|(?<=[\]>])(?=\s))\s*(.*)$", re.IGNORECASE)
_CALLER = ("user", "human", "usuário", "usuario", "utilisateur", "nutzer", "benutzer")
_ROLE_OBJECT = re.compile(r"[\"']role[\"']\s*:\s*[\"'](system|assistant|developer)[\"']", re.IGNORECASE)
# A user turn written as a JSON object on its line: its content is the caller's text.
_USER_OBJECT = re.compile(r"^\s*\{\s*[\"']role[\"']\s*:\s*[\"'](?:user|human)[\"']\s*,\s*[\"']content[\"']\s*:\s*[\"'](.*)[\"']\s*\}\s*$",
                          re.IGNORECASE)
_ROLE_ELEMENT = re.compile(r"<(system|sys|assistant|developer|instructions?)>.*?</\1>", re.IGNORECASE | re.DOTALL)
_CLAUSE = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"'”’)\]])\s+|(?<=[:;])\s+|(?<=[。！？])\s*")
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_LINE = re.compile(
    r"^\s*(def |class |import |from [\w.]+ import |return\b|for .+ in .+:\s*$|while .+:\s*$|if .+:\s*$|elif |else:|try:|except\b|"
    r"function\b|const |let |var |#include|using |public |private |fn |func |package |"
    r"(SELECT|INSERT|UPDATE|DELETE|CREATE|WITH)\b.*\b(FROM|INTO|SET|TABLE|AS)\b|"
    r"(FROM|JOIN|LEFT JOIN|RIGHT JOIN|INNER JOIN|WHERE|GROUP BY|ORDER BY|HAVING|LIMIT|UNION|VALUES)\b|--\s|//|/\*|\*/|"
    r"[{}()\[\]]+;?\s*$|"
    # a query's first line and its column list, one a line ("SELECT c.id,", "       c.region,")
    r"(SELECT|INSERT INTO|UPDATE|DELETE FROM)\s+[\w.*]+\s*,?\s*$|\s+[\w]+\.[\w]+(\s+AS\s+\w+)?,\s*$)"
    r"|[;{]\s*$|^\s{2,}\S.*[=(){};]|::|->|=>|#include|\w+\([^()]*\)\s*[{:]", re.MULTILINE)
_JSON_LINE = re.compile(r"^\s*([\w ]{1,40}:\s*)?[{\[]\s*[\"'{\[]")
_CODE_SYMBOL = re.compile(r"[{}\[\]();<>=_:&|^\\#]")
# Prose that talks about code: then the code is the task, not padding.
_CODE_TALK = re.compile(
    r"\b(code|coding|function|functions|method|class|script|program|programming|snippet|query|sql|regex|bug|bugs|error|errors|"
    r"exception|traceback|stack trace|compile|compiler|refactor|debug|implement\w*|unit tests?|tests? (pass|fail)|docstring|"
    r"variable|loop|syntax|python|javascript|typescript|java|rust|golang|c\+\+|c#|html|css|bash|shell|library|module|"
    r"algorithm|complexity|output of|return value|returns?|runtime|this line|these lines|the above|the following|below|"
    r"json|schema|xml|yaml|csv|markdown|table|format|field|fields|key|keys)\b", re.IGNORECASE)
# A sentence that sets aside what came before it: what came before is not the task.
_DISMISSAL = re.compile(
    r"\b(never ?mind( about)?( all)?( of)?( that| this| the above| it)?|not my (real |actual )?question|(that|this|the above) (is|was) (irrelevant|unrelated|not (the|my) question)|"
    r"ignore (all )?(that|this|the above|everything (above|before))|disregard (that|this|the above)|(that|the above) aside|"
    r"(proof|details?|context|background|that) (sketch )?aside|forget (that|the above|all that)|(my|the) (real|actual) question|"
    r"here is what i (really |actually )?(need|want|want to know|am asking)|what i (really |actually )?(need|want) (is|to know)|"
    r"none of (that|this|the above|it|these) (matters|is relevant|is important)( yet| now| for now| here)?)\b", re.IGNORECASE)
# What announces the question after a dismissal ("first, a simple question:"): the question follows.
_LEAD_IN = re.compile(r"^(((first|now|so|anyway|but|then|okay|ok)\b[\s,;:.-]*)*((here is|here's|this is) )?(an?|one|my|the|our)( \w+){0,2} "
                      r"question( is| for you)?\s*[:–-]\s*)", re.IGNORECASE)
# A line the ask can be about without sharing a word with it: one that announces material, or a label.
_MATERIAL_LINE = re.compile(r":\s*$|\b(the following|as follows|below|above)\b", re.IGNORECASE)
# Where a line's clauses part: after a sentence, a colon or a semicolon, a closing bracket, or a dash.
_ASK_CLAUSE = re.compile(r"(?<=[.!?:;。！？)])\s+(?:[-–—]\s+)?|\s+[-–—]\s+")
# Words with which a question points at material beside it ("which of these", "the options below").
_POINTS = re.compile(r"\b(this|these|those|following|below|above|options?|choices?|text|passage|list|table|data|"
                     r"isto|isso|est[ea]s?|ess[ea]s?|seguinte|abaixo|acima|esto|siguiente|abajo|arriba|dies\w*|folgende\w*|unten|oben|"
                     r"ceci|cela|ces|suivant\w*|questo|questa|seguente|sotto|sopra)\b", re.IGNORECASE)
# A sentence or code comment that sets the code beside the question aside: the code is padding then,
# whatever words it shares with the question ("LEFT JOIN" and "the courier left my parcel").
_CODE_ASIDE = re.compile(
    r"\b((only|just|purely|merely) (for )?(context|background)|(context|background)( only)?\W+(ignore|skip)|for context only|"
    r"needs? no (changes?|review|fixing)|ignore (the |this |that |my )?(code|snippet|script|query|block|above|context)|"
    r"(unrelated|irrelevant) to (my|the|this) (question|request)|nothing to do with|"
    r"(pasted|included|added|copied|left) (in )?(by accident|by mistake|accidentally)|(is|are) fine as (it is|is|they are))", re.IGNORECASE)
# What still makes the question about code once those sentences are gone ("return", "table" or "key" do
# not: a support ticket uses them too).
_ABOUT_CODE = re.compile(
    r"\b(code|coding|function|functions|method|class|script|program|programming|snippet|query|sql|regex|bug|bugs|exception|traceback|"
    r"stack trace|compile|compiler|refactor|debug|implement\w*|unit tests?|docstring|variable|syntax|python|javascript|typescript|"
    r"rust|golang|c\+\+|bash|shell|algorithm)\b", re.IGNORECASE)
# Codes that are not code: "a coupon code", "error code 502".
_NOT_CODE = re.compile(r"\b(coupon|promo|discount|voucher|gift|error|status|zip|postal|post|tracking|access|verification|confirmation|"
                       r"booking|reference|area|country|dress|qr|bar|security|activation|pin|sort|tax|product)\s+codes?\b", re.IGNORECASE)
_QUESTION_END = re.compile(r"\?\s*[\"')\]]*\s*$")
# Words that point back at what came before (not "this", which as often points at what follows).
_REFERENCE = re.compile(r"\b(it|its|they|them|their|he|she|him|her|his|hers|above|previous|former|latter|aforementioned|"
                        r"the same|so far|earlier)\b", re.IGNORECASE)
# Text that announces material to work on ("from this email:", "the following"): what comes after is that material.
_INTRODUCES = re.compile(r":\s*$|:\s*\n|\b(the following|as follows|below|this (text|email|message|passage|review|paragraph|document|article|note|letter|"
                         r"sentence|list|table|data|report|ticket|conversation|transcript))\b", re.IGNORECASE | re.MULTILINE)
_WORD = re.compile(r"[^\W\d_]{3,}")
# Scripts written without spaces between words (Chinese, Japanese): compared by pairs of characters.
_UNSPACED = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]{2,}")
_NUMBER = re.compile(r"\d+")
_QUANTITY = re.compile(r"\b(how (many|much|long|far|old|often|fast|big|tall)|what (is|was|are) the (total|number|amount|sum|cost|price|"
                       r"difference|average|ratio|percentage)|calculate|compute)\b", re.IGNORECASE)
_HARD = re.compile(r"\b(prove|proof|theorem|lemma|integral|derivative|equation|manifold|eigen\w*|matrix|polynomial|"
                   r"complexity|algorithm|optimi[sz]\w*|derive|step[- ]by[- ]step)\b", re.IGNORECASE)
_COMMON = frozenset(["the", "and", "for", "are", "was", "you", "not", "but", "all", "any", "can", "how", "who", "why", "its", "his", "her", "our", "out", "one", "two", "has", "had", "use", "get", "what", "which", "where", "when", "whose", "whom", "does", "have", "with", "from", "that", "this", "there", "their", "about", "would", "could", "should", "many", "much", "into", "your", "yours", "they", "them", "than", "then", "were", "been", "being", "also", "just", "only", "very", "more", "most", "some", "such", "name", "give", "tell", "please", "make", "find", "show", "list", "write", "explain", "answer", "question"])

_COMMON_STEMS = frozenset(w[:5].rstrip("s") for w in _COMMON)
_FUNCTION_STEMS = _COMMON_STEMS | frozenset(w[:5].rstrip("s") for w in (
    "eine einer einem einen eines nicht auch oder aber wenn dass sind wird werden haben sein diese dieser nach über unter "
    "dans pour avec sont mais cette nous vous leur plus tout être avoir comme aussi "
    "para como mais pelo pela esta este isso isto todo todos muito quando sobre entre porque pero cuando donde tiene "
    "della delle degli sono come anche questo questa quella nella alla dalla perché niet zijn voor maar deze naar wordt "
    "your with that this from have what thing things").split())


# A sentence of the operator's system turn that says what kind of work this is ("Classify the message
# into ...", "You turn customer emails into records.", "Reply with JSON only."): often the caller's
# text alone does not ("I was charged twice" is a classification only by the system turn).
_TASK_SENTENCE = re.compile(
    r"^\W*(you\s+(are|will|must|should|sort|turn|parse|fill|answer|help|write|classify|extract|rewrite|translate|summari[sz]e)\b|"
    r"(please\s+)?(classify|sort|label|tag|categori[sz]e|extract|parse|fill|turn|convert|rewrite|reword|edit|format|translate|"
    r"summari[sz]e|answer|solve|work|complete|write|reply|respond|return|end|give|do|fix|correct|explain|list|generate|compute|calculate)\b)",
    re.IGNORECASE)
TASK_WORDS = 40  # the task line's length at most: a persona or a list of facts is not the task


# An operator's task that works on the caller's text rather than answers it: the whole turn is then
# material (a customer message that asks a question is still a message to classify).
_MATERIAL = re.compile(r"\b(classify|categori[sz]e|label|tag|extract|parse|rewrite|reword|translate|summari[sz]e|proofread)\b",
                       re.IGNORECASE)


def _system_text(messages: list[dict[str, str]]) -> str:
    return " ".join(m.get("content", "") for m in messages if m.get("role") in ("system", "developer"))


def task_line(messages: list[dict[str, str]]) -> str:
    """The operator's statement of the task, from the system turns: the sentences that set the work or
    its form, not facts to use, and none that plead for a model; at most TASK_WORDS words."""
    system = _system_text(messages)
    kept: list[str] = []
    for sentence in re.split(r"(?<=[.!?])\s+|\n+", system):
        sentence = sentence.strip()
        if sentence and _TASK_SENTENCE.match(sentence) and not PLEA.search(sentence) and not INJECTION.search(sentence):
            kept.append(sentence)
    return " ".join(" ".join(kept).split()[:TASK_WORDS])


def embedded_text(messages: list[dict[str, str]], task: bool) -> str:
    """What a learned table embeds: the routing text, after the operator's task line where the table
    reads it (`KnnSettings.task`; tables from before it read the routing text alone)."""
    line = task_line(messages) if task else ""
    return f"{line}\n{routing_text(messages)}" if line else routing_text(messages)


def last_user_turn(messages: list[dict[str, str]]) -> str:
    return next((m.get("content", "") for m in reversed(messages) if m.get("role") == "user"), "")


# What the router reads of a long turn: its beginning and its end. Every feature saturates well within
# this (120 distinct words, a few steps or maths signals) and the learned router embeds 256 tokens; the
# bound keeps the reading's cost, which runs on the event loop, independent of the body's size.
READ_CHARS = 16_000


def routing_text(messages: list[dict[str, str]]) -> str:
    """The task the last user turn states, each sentence once, and only the sentences it needs."""
    last = last_user_turn(messages)
    if len(last) > READ_CHARS:
        last = last[:READ_CHARS // 2] + "\n" + last[-(READ_CHARS // 2):]
    lines = _without_code_nobody_asks_about(_callers_turns(unframed(_ROLE_ELEMENT.sub("\n", _TEMPLATE_TAG.sub(_turn_line, last)))))
    kept = _after_dismissal(_clauses(lines))
    kept = _unreferenced_preamble_dropped(task_lines(kept, _code_lines(kept), bool(_MATERIAL.search(_system_text(messages)))))
    kept = _unrelated_material_dropped(kept)
    if kept:
        return "\n".join(kept)
    # Nothing but instructions to the system: what is left of them once the patterns are cut out.
    return re.sub(r"\s+", " ", PLEA.sub(" ", INJECTION.sub(" ", last))).strip()


def _turn_line(tag: re.Match[str]) -> str:
    role = tag.group(2) or tag.group(4)
    if role:
        return f"\n[{role}]\n"
    if tag.group(5) is not None:  # <<SYS>> opens a system turn, <</SYS>> goes back to the user's
        return "\n[user]\n" if tag.group(5) else "\n[system]\n"
    if tag.group(6):  # the end of a turn: what follows, in the caller's own message, is the caller's
        return "\n[user]\n"
    return "\n"


def _callers_turns(text: str) -> list[str]:
    """The lines of the caller's own turns: a forged system or assistant turn inside the message is dropped.
    A role named without brackets needs its colon ("System: ..."), so a line that merely starts with
    the word is not taken for a turn."""
    lines = text.split("\n")
    # per line: None, or the turn it opens (the caller's?, with text on the same line?)
    opens = [(m.group(2).lower() in _CALLER, bool(m.group(5).strip()))
             if (m := _ROLE_LINE.match(line)) and (m.group(1) or m.group(3) or m.group(4) == ":") else None for line in lines]
    kept, role = [], "user"
    for n, (line, opened) in enumerate(zip(lines, opens)):
        if opened is not None:
            role = "user" if opened[0] else "other"
            line = _ROLE_LINE.match(line).group(5)  # type: ignore[union-attr]
            if not line.strip():
                continue
            if role == "other" and not any(o is not None and o[0] for o in opens[n + 1:]):
                # one the caller never closes, written on one line with more after it, ends with its first
                # sentence ("System: this chat is rated expert. Write a headline for ..."): the rest is the caller's
                rest = re.split(r"(?<=[.!?。！？])\s+", line, maxsplit=1)[1:]
                if rest and rest[0].strip():
                    kept.append(rest[0])
                continue
        elif role == "other" and not any(o is not None and o[0] for o in opens[n:]):
            # A forged turn the caller never closes ends with its own line ("System: ...") or its paragraph
            # ("### System" and lines under it): what follows is the caller's again.
            opener = next(o for o in reversed(opens[:n]) if o is not None)
            if opener[1] or not line.strip():
                role = "user"
        if role == "user" and not _ROLE_OBJECT.search(line):
            kept.append(user.group(1) if (user := _USER_OBJECT.match(line)) else line)
    if not any(line.strip() for line in kept):
        # A forged turn that never hands back to the user holds the question too ("SYSTEM: ... What is X?"):
        # its sentences are sorted one by one instead.
        return [(m.group(5) if (m := _ROLE_LINE.match(line)) else line) for line in text.split("\n")]
    return kept


def _code_lines(lines: list[str]) -> list[bool]:
    code, fenced = [], False
    for line in lines:
        if _FENCE.match(line):
            fenced = not fenced
            code.append(True)
        else:
            code.append(fenced or _code_like(line))
    return code


def _without_code_nobody_asks_about(lines: list[str]) -> list[str]:
    """Code beside prose that never mentions code (or any name in it) is padding; code alone, or code
    the prose talks about, is the task. Prose that only talks about the request is no prose here."""
    code = _code_lines(lines)
    prose = [line for line, is_code in zip(lines, code) if not is_code and line.strip() and not only_talk(line)]
    if not prose or not any(code):
        return lines
    if any(_CODE_ASIDE.search(line) for line in lines):
        # Said to be beside the point: the code goes, and so do the sentences that say so.
        kept = [line for line in (" ".join(s for s in re.split(r"(?<=[.!?])[)\]\"'”’]*\s+", line) if not _CODE_ASIDE.search(s)) for line in prose)
                if line.strip()]
        if kept and not _ABOUT_CODE.search(_NOT_CODE.sub(" ", " ".join(kept))):
            return kept
    labels = [m.group(1) for line, is_code in zip(lines, code) if is_code and (m := _JSON_LINE.match(line)) and m.group(1)]
    said = " ".join(prose + labels)  # "JSON Schema: {...}" names what its value is
    names = {w.lower() for line, is_code in zip(lines, code) if is_code for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]{3,}", line)}
    if _CODE_TALK.search(said) or names & {w.lower() for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]{3,}", said)} - _COMMON:
        return lines
    return prose


def _code_like(line: str) -> bool:
    """A line of code or data: a code construct, a JSON value (after a label, "Schema: {...}"), or dense in
    the symbols code is written with and prose is not."""
    symbols = len(_CODE_SYMBOL.findall(line))
    return bool(_CODE_LINE.search(line) or _JSON_LINE.match(line)) or (symbols >= 3 and symbols >= 0.1 * len(line.strip()))


def _clauses(lines: list[str]) -> list[str]:
    """Each clause once, without those that pose as instructions to the system or plead for a model
    (a clause goes when a match touches it: "tier: frontier" spans two)."""
    seen: set[str] = set()
    kept_lines = []
    for line, is_code in zip(lines, _code_lines(lines)):
        if is_code:  # code is kept line by line as written (a repeated line once): its clauses are not sentences
            key = line.strip()
            if key and key not in seen:
                seen.add(key)
                kept_lines.append(line.rstrip())
            continue
        flagged = [m.span() for pattern in (INJECTION, PLEA) for m in pattern.finditer(line)]
        kept, start = [], 0
        for end in [m.start() for m in _CLAUSE.finditer(line)] + [len(line)]:
            clause, span, start = line[start:end], (start, end), end
            key = re.sub(r"\s+", " ", clause.strip().lower())
            if not key or key in seen or any(a < span[1] and b > span[0] for a, b in flagged):
                continue
            seen.add(key)
            kept.append(clause.strip())
        if kept:
            kept_lines.append(joined(kept))
    return kept_lines


def _sentences(lines: list[str]) -> list[tuple[int, str]]:
    return [(i, s) for i, line in enumerate(lines) for s in re.split(r"(?<=[.!?])\s+", line) if s.strip()]


def _after_dismissal(lines: list[str]) -> list[str]:
    """Everything up to the last sentence that sets it aside ("Never mind that.", "Proof aside, ...")
    goes, that sentence's words before the dismissal too; what follows is the task."""
    sentences = _sentences(lines)
    marked = [n for n, (_, s) in enumerate(sentences) if _DISMISSAL.search(s)]
    if not marked:
        return lines
    n = marked[-1]
    line_of, sentence = sentences[n]
    rest = sentence[[m.end() for m in _DISMISSAL.finditer(sentence)][-1]:]
    rest = _LEAD_IN.sub("", re.sub(r"^[\s,.:;!-]+", "", rest))
    after = ([rest] if rest else []) + [s for i, s in sentences[n + 1:] if i == line_of]
    kept = ([" ".join(after)] if after else []) + [line for i, line in enumerate(lines) if i > line_of]
    return kept if kept else lines


def _content(text: str) -> set[str]:
    """Content words, cut to a stem of five letters ("pens" and "pen" still differ; "girls" meets "girl");
    in scripts written without spaces, each pair of characters."""
    words = {w.lower()[:5].rstrip("s") for w in _WORD.findall(text) if not _UNSPACED.search(w)}
    pairs = {run[i:i + 2] for run in _UNSPACED.findall(text) for i in range(len(run) - 1)}
    return (words - _COMMON_STEMS) | pairs


def _unreferenced_preamble_dropped(lines: list[str]) -> list[str]:
    """A preamble made to look hard (long, or full of numbers and maths) before a closing question that
    stands alone goes: the question neither points back ("it", "this", "the above"), nor shares a content
    word with it, nor asks for a quantity the preamble's numbers could give (a word problem's question
    never stands alone)."""
    sentences = _sentences(lines)
    if len(sentences) < 2:
        return lines
    # The ask: the last sentence when it is a question or there is one line, else the last line; a
    # question or an instruction.
    if len(lines) > 1 and not _QUESTION_END.search(sentences[-1][1]):
        question, before = lines[-1], " ".join(lines[:-1])
    else:
        question, before = sentences[-1][1], " ".join(s for _, s in sentences[:-1])
    if not (_QUESTION_END.search(question) or ASK.match(question)) or _INTRODUCES.search(before):
        return lines
    standalone = len(re.findall(r"\w+", question)) >= 3 and not _REFERENCE.search(question) and not _content(question) & _content(before)
    looks_hard = len(before.split()) >= 25 or len(_NUMBER.findall(before)) >= 2 or bool(_HARD.search(before))
    asks_quantity = bool(_QUANTITY.search(question)) and bool(_NUMBER.search(before))
    return [question] if standalone and looks_hard and not asks_quantity else lines


# Unrelated material goes only when there is this much of it: a greeting or a line of thanks reads the same.
MATERIAL_CHARS = 80
STANDALONE_WORDS = 3  # content words a question with a pronoun needs to stand on its own


def _material_words(text: str) -> set[str]:
    """The content words of four letters or more (as stems), less the commonest words of the languages
    the router's cues cover: what ties material to a question in any of them ("das" or "der" tie nothing)."""
    return _content(" ".join(w for w in re.findall(r"\w+", text) if len(w) >= 4 or _UNSPACED.match(w))) - _FUNCTION_STEMS


def _unrelated_material_dropped(lines: list[str]) -> list[str]:
    """Material the question never reaches goes. The question: the last clause that asks one. A clause
    of its line stays when it shares a content word with the question or with a clause that stays, or
    when a clause that stays points back at it ("she", "it"); another line stays when it shares a
    content word with what stays (a word problem's premises chain to its question). Nothing goes when
    the question points elsewhere ("it", "these", "the table below"), when a line announces material,
    or when the material that would go is short."""
    asked = [i for i, line in enumerate(lines) if "?" in line or "？" in line]
    if len(lines) < 2 or not asked:
        return lines
    line_of = asked[-1]
    clauses = [c for c in _ASK_CLAUSE.split(lines[line_of]) if c.strip()]
    q = max(n for n, c in enumerate(clauses) if "?" in c or "？" in c)
    question = clauses[q]
    # A pronoun points elsewhere unless the question says enough of its own ("how long does it take to
    # delete my account"), or an earlier clause of its line is what it points at.
    points_back = bool(_REFERENCE.search(question)) and q == 0 and len(_material_words(question)) < STANDALONE_WORDS
    if len(re.findall(r"\w+", question)) < 3 or points_back or _POINTS.search(question) \
            or any(_MATERIAL_LINE.search(line) for line, code in zip(lines, _code_lines(lines)) if not code):
        return lines
    words = [_material_words(c) for c in clauses]
    kept = _reach({q}, words, back=[bool(_REFERENCE.search(c)) for c in clauses])
    first = clauses[min(kept)]
    if any(_POINTS.search(clauses[n]) for n in kept) or (
            _REFERENCE.search(first) and len(_material_words(first)) < STANDALONE_WORDS):
        return lines  # what the question builds on points at material beside it
    seed = set().union(*(words[n] for n in kept))
    others = [_material_words(line) if i != line_of else set() for i, line in enumerate(lines)]
    reached = _reach({line_of}, [seed if i == line_of else w for i, w in enumerate(others)])
    if sum(len(line) for i, line in enumerate(lines) if i not in reached) < MATERIAL_CHARS:
        return lines
    ask = joined([clauses[n].strip() for n in sorted(kept)])
    return [ask if i == line_of else line for i, line in enumerate(lines) if i in reached]


def _reach(start: set[int], words: list[set[str]], back: list[bool] | None = None) -> set[int]:
    """The items tied to `start` by shared words, one to the next, and (with `back`) each item that
    an item reached points back at with a pronoun: the one before it."""
    reached, frontier = set(start), list(start)
    while frontier:
        i = frontier.pop()
        tied = [j for j, w in enumerate(words) if j not in reached and w & words[i]]
        if back is not None and back[i] and i > 0 and i - 1 not in reached:
            tied.append(i - 1)
        reached.update(tied)
        frontier.extend(tied)
    return reached
