"""Which parts of a caller's turn state the task, and which only talk about it.

What a caller writes about a request (how hard, urgent or important it is, who allowed what, how
carefully to think, which model should answer, a metadata block, thanks and greetings) is not what
the request needs, in any language. The turn is cut into segments (sentences in any script, a label
before its colon, runs of emoji, markup tags), and a segment goes when it talks about the request
and shares no content word with the ask (its question, or else the rest of the turn). A segment is
judged on its own words and the ask's alone, so talk added around a question leaves the text the
router reads, and with it every feature and the learned router's embedding, exactly as they were:
such text can never buy a dearer tier. Beside a question that stands alone (it points at nothing
outside itself), the rule turns round: prose is read only where the question refers to it (a shared
word, a number it lacks, a colon, a chain of pronouns back to a premise), whatever its words. Pure.
"""

from __future__ import annotations

import functools
import re
import unicodedata

# Markup tags (`<routing tier="x"/>`, `</body>`): a boundary between segments, their attributes nobody's task.
_TAG = re.compile(r"</?[A-Za-z][\w:.-]*(?:\s+[\w:.-]+(?:\s*=\s*(?:\"[^\"]*\"|'[^']*'|[^\s\"'>/]+))?)*\s*/?>")
# Where a segment ends: a sentence's end in any script, a label's colon, a semicolon before a new sentence.
_SEGMENT_END = re.compile(r"(?<=[.!?。！？؟…])[\"'”’»)\]*_]*\s+|(?<=[:：])[*_]*\s+|(?<=[;；])\s+(?=[^\W\d_]*[A-ZÀ-Þ¿¡])|"
                          r"(?<=[。！？])")
# A sentence that asks for something (an instruction or a question without its mark, in English).
ASK = re.compile(r"^\W*(please\W+)?(classify|translate|name|list|give|tell|spell|summari[sz]e|rewrite|extract|write|say|define|convert|"
                 r"explain|describe|identify|answer|compute|calculate|solve|prove|derive|show|find|determine|simplify|implement|fix|"
                 r"debug|create|generate|sort|count|estimate|what|who|where|when|which|why|how|is|are|does|do|can)\b",
                 re.IGNORECASE)
_QUESTION = re.compile(r"[?？؟][\s\"'”’»)\]*_]*$")
_DIGIT = re.compile(r"\d")
_LETTERS = re.compile(r"[^\W\d_]+")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")
# A run of symbols standing alone ("@@ metadata ... @@", "|| ... ||"): a frame, a boundary between segments.
_SYMBOL_RUN = re.compile(r"(?<!\S)(?:@{2,}|#{2,}|~{2,}|\^{2,}|\|{2,})(?!\S)")
_EMOJI = re.compile("[\U0001F000-\U0010FFFF\u2600-\u27BF\u2B00-\u2BFF\uFE0F\u200D]+")

# Words of any of the languages below that carry no content of their own: function words, greetings
# and thanks, the names of chat turns, and the words every request uses about itself.
_FILLER = frozenset("""
the and for are was were been being you your yours not but all any can cannot how who why its his her our out one has had
have with from that this these those there their they them than then what which where when whose whom does did into about
much many every each other another same own even still yet ever never always often don doesn didn isn aren wasn weren
something anything everything nothing someone anyone unrelated lot lots
won wouldn couldn shouldn haven hasn
would could should will shall may might must also just only very more most some such here now well yes okay really so
please thanks thank hello good morning afternoon evening dear regards cheers kindly grateful advance anyway actually
question questions answer answers reply request requests query task thing following below above like know want need
user human assistant bot message messages chat conversation previous history turn help get give tell make let
les des une est que qui pour dans par sur avec pas plus vous nous sont ont cette ceci cela ici merci bonjour bonsoir
svp voici voila reponse demande utilisateur mais tres bien plait aide historique precedent etre avoir fait faire
tout tous toute elle ils elles leur leurs son ses mon mes ton tes notre votre aux comme quand alors donc aussi
los las una del por para con que como esta este esto eso son muy mas sin ante sobre todo toda gracias hola favor
pregunta respuesta usuario asistente aqui ayuda historial anterior pero porque cuando donde tambien esto ese esa
hay ser estar tiene tengo puede puedo hacer sus mis tus nos les
uma dos das pelo pela com nao sim isso isto disso nisso desse dessa aqui obrigado obrigada ola resposta voce voces ajuda
historico mas mais porque quando onde tambem tem tenho pode posso fazer ser estar meu minha seu sua nada nenhum nenhuma
muito muita jeito
der die das und ist ein eine einen dem den des mit von fur auf bei nicht ich sie wir ihr bitte danke hallo hier frage
antwort nutzer benutzer assistent diese dieser dieses hilfe bisheriger bisherige verlauf vorherige auch aber oder wenn
wie was wer wo sich sind war hat habe haben kann kannst mein meine dein deine sein seine nur noch schon also
gli della delle per con che non sono questa questo grazie ciao domanda risposta utente assistente anche
это очень вопрос ответ пожалуйста как что для все так его она они мне меня вас вы
""".split())

# Talk about the request rather than of it, accent-folded and lower-cased: whole words, or a word's
# beginning where marked `*`. A strong cue alone makes a short segment talk; a weak one needs a
# second (a "model" may be a car's, a "router" the one at home, "best" or "hard" the question's own).
_STRONG = """
llm llms gpt* chatgpt frontier fronteira frontera frontiere flagship top-tier high-end state-of-the-art
override* pre-approved mission-critical olympiad* olimpiad* genius genio genie
expertise expertenwissen anspruchsvoll* redoutable urgent* dringend*
carefully careful thoroughly thorough meticulous* methodical* deliberat* rigor rigour rigorous* rigoros* exhaustiv*
erschopf* comprehensive encyclopedic enciclopedic* encyclopedi* ausfuhrlich* step-by-step double-check cuidadosa*
cuidadosamente soigneu* attentivement sorgfalt* grundlich* minucios* scrupul* lifesaver step+by+step paso+a+paso
passo+a+passo etape+par+etape schritt+fur+schritt stap+voor+stap adim+adim
"""
_WEAK = """
claude gemini tier tiers routing router route reroute escalat* upgrade* premium admin admins administrat* administrad*
systemadministrator authoris* authoriz* autoris* autoriz* aprovad* aprobad* approuv* approved approval genehmig* freigegeb*
berechtig* sudo clearance cleared enterprise platinum vip sla ceo cto phd phds doctora* doutora* doktor* nobel laureat*
brilliant brillant* expert experts experto expertos especialista* sophisticated sofisticad* deceptive* trick
priorit* priorid* critical critica critico critique kritisch* crucial ultra cuidado
fired despedid* demitid* gekundigt desperate desesperad* supplie beg begging stressed crying garbage toy fraquinho
mini-modell billig*
model* modle ai ia ki system* sistem* yonetici onay* moeilijk* zorgvuldig* belangrijk* trudn* najlepsz* wazne pilne
onemli acil dikkatli* esperto approvato attenzione properly
engine brain cerebro cerebros cerveau gehirn intelligen* inteligen* capab* capacit* fahigkeit* power powerful potente
puissant* leistungsstark* strongest stronger smartest smart big large small smaller little tiny
best beste besten better meilleur* mejor mejores melhor melhores migliore biggest largest bigger larger maior mayor grosste
most highest hochste* maximum maxima maximo maximal max top finest superior superieur* advanced avance* avanzad* avancad*
fortgeschritten*
hard hardest harder difficult difficulty dificil dificiles difficile difficiles schwer schwierig* complex complexe
complexity complejo compleja complexo complexa komplex complicad* tricky challenging
extreme extremely extrema extremo extremadamente extremamente extrem extremement simple simpler
important importante importance importancia wichtig* serious seriousness serio seria matters matter depend depends depende
dependen lives vida vidas carriere carrera carreira karriere job emprego trabajo promotion mistake mistakes wrong errar
perfect perfectly manager boss
accuracy accurate precise precision precisao genau prazis*
detailed detalhada detalhado detallada detallado detaillee detaille detail details complete completa completo
vollstandig* deep profunda profundo approfondi* slowly lentement reason reasoning razonamiento raciocinio raisonnement
think thinking piensa pense pensez reflechissez reflechis denk denke nachdenken
step steps paso pasos passo etape schritt consider considering revisa revise verifiez verifie check
pay paid paying pago zahle cheap quality qualidade calidad qualite qualitat level nivel niveau stufe
pretend imagine act actua aja you+are+a you+are+an you+are+now eres+un eres+una voce+e+um voce+e+uma vous+etes
tu+es+un tu+es+une du+bist sie+sind+ein sei+un sei+una think+it+through take+your+time panel committee comite professors
profesores professeurs professori professoren
catedraticos chercheurs researchers
exam exams examen exame prufung competition concours concurso
warning attention achtung aviso atencion note nota hinweis budget unlimited ilimitado illimite unbegrenzt
"""


def _words(spec: str) -> str:
    """Alternatives of a pattern from a list: `stem*` a word's beginning, `a+b` words in a row."""
    words = sorted(set(spec.split()), key=len, reverse=True)
    return "|".join(w[:-1].replace("+", r"\s+") if w.endswith("*") else w.replace("+", r"\s+") + r"(?![^\W\d_])" for w in words)


_CUE = re.compile(rf"(?<![^\W\d_])(?:(?P<strong>{_words(_STRONG)})|(?P<weak>{_words(_WEAK)}))")


def fold(text: str) -> str:
    """Lower case without accents ("difícil" reads as "dificil", "größte" as "grosste")."""
    if text.isascii():
        return text.lower()
    decomposed = unicodedata.normalize("NFKD", text.lower().replace("ß", "ss"))
    return "".join(c for c in decomposed if not unicodedata.combining(c))


# A period that ends an abbreviation ("Dr.", "P.O.", "e.g."), not a sentence.
_ABBREVIATION = re.compile(r"[\s(](?:(?:[^\W\d_]\.)+|(?:mr|mrs|ms|dr|st|prof|sr|jr|vs|etc|no|nr)\.)$", re.IGNORECASE)
# "budget = unlimited": a setting's name is a label, as "priority:" is.
_ASSIGN = re.compile(r"^(\s*[^\W\d][\w.-]{2,30}\s*=)\s+")
# A lead-in that is the first half of a question ("Financially, which comes out better: ...").
_WH = re.compile(r"\b(which|what|who|whom|whose|how|why|where|when)\b", re.IGNORECASE)
_LEAD_IN = re.compile(r":[\s*_]*$|^\s*#{1,6}\s")


# The same for scripts without spaces between words (and Cyrillic, whose words the pattern above
# never starts): each a weak cue of its own.
_CUE_CJK = re.compile(fold(r"非常|极其|極めて|模型|最好|最强|最先进|顶级|高级|困难|很难|复杂|专家|仔细|认真|"
                           r"一步一步|逐步|详细|管理员|授权|优先|紧急|重要|"
                           r"モデル|最高|最強|難し|複雑|専門|慎重|丁寧|詳しく|管理者|承認|優先|緊急|"
                           r"модел|лучш|мощн|сложн|трудн|эксперт|тщательн|подробн|"
                           r"администратор|приоритет|срочн|важн|шаг за шагом"))


def split_segments(line: str) -> list[str]:
    """The segments of one line of prose: sentences in any script, a label before its colon or its
    `=`, the text between markup tags, between runs of emoji and between runs of symbols."""
    # "budget = unlimited" is a setting, "tablespoon = how many teaspoons?" one question
    labelled = _ASSIGN.sub(lambda m: m.group(0) if line[m.end():m.end() + 1].islower() and _QUESTION.search(line)
                           else m.group(1) + "\n", line)
    text = _EMOJI.sub("\n", _TAG.sub("\n", _SYMBOL_RUN.sub("\n", labelled)))
    segments = []
    for piece in text.split("\n"):
        start = 0
        for end in _SEGMENT_END.finditer(piece):
            lo = max(start, end.start() - 24)  # an abbreviation is short: only the tail is read, so this stays linear
            if not _ABBREVIATION.search((" " if lo == start else "") + piece[lo:end.start()]):
                segments.append(piece[start:end.start()])
                start = end.end()
        segments.append(piece[start:])
    return [s.strip() for s in segments if s.strip()]


@functools.lru_cache(maxsize=256)
def content(segment: str) -> frozenset[str]:
    """Content words cut to a six-letter stem, filler and talk about the request left out; in a
    script without spaces, its pairs of characters."""
    folded = fold(segment)
    cue = bytearray(len(folded) + 1)  # which characters a cue covers
    for pattern in (_CUE, _CUE_CJK):
        for found in pattern.finditer(folded):
            cue[found.start():found.end()] = b"\x01" * (found.end() - found.start())
    words = set()
    for m in _LETTERS.finditer(folded):
        word = m.group()
        if not word.isascii() and _CJK.search(word):
            words |= {word[i:i + 2] for i in range(max(1, len(word) - 1))}
        elif len(word) >= 3 and not cue[m.start()] and word not in _FILLER:
            words.add(word[:6].rstrip("s"))
    return frozenset(words)


TALK_SHARE = 0.25  # cues (strong 1, weak 1/2) per other content word from which a sentence is talk, not material


def cues(segment: str) -> float:
    """How much a segment talks about the request: 1 for each strong cue, 1/2 for each weak one."""
    folded = fold(segment)
    return sum(1.0 if m.group("strong") is not None else 0.5 for m in _CUE.finditer(folded)) + 0.5 * len(_CUE_CJK.findall(folded))


def _word_count(segment: str) -> int:
    """Content words, the characters of a script without spaces counting one word per four."""
    found = content(segment)
    return sum(1 for w in found if not _CJK.match(w)) + len(_CJK.findall(segment)) // 4


def talk(segment: str) -> bool:
    """Whether a segment talks about the request: its cues (one strong or two weak) outweigh its other
    content words, or a cue leads into what follows ("... can do justice to this:"), or nothing is left
    once filler is set aside (a greeting, "Anyway:", a turn's name, a lone label)."""
    score, words = cues(segment), _word_count(segment)
    if score >= 1 and score >= TALK_SHARE * words or score and _LEAD_IN.search(segment) and not _WH.search(segment):
        return True
    return not words and not _DIGIT.search(segment) and not _QUESTION.search(segment)  # "How?" still asks


def joined(parts: list[str]) -> str:
    """Sentences back on one line: a space after each, none after "。" (that script puts none)."""
    return "".join(p + ("" if p.endswith(("。", "！", "？")) else " ") for p in parts).rstrip()


def only_talk(line: str) -> bool:
    """A line of prose that asks nothing and only talks about the request."""
    segments = split_segments(line)
    return bool(segments) and not any(_QUESTION.search(s) or ASK.match(s) for s in segments) and all(map(talk, segments))


def task_lines(lines: list[str], code: list[bool], material: bool = False) -> list[str]:
    """`lines` without the segments that talk about the request and are not tied to the ask by its
    content words (two, or one where the segment states a number). The ask: the questions that do
    not talk; with none, every segment that does not talk; with none of those either, the questions.
    With a question, a fragment of one content word or none is never the task either, and a label
    goes with the value it introduces. Code lines stay as they are (whether code is padding is
    decided before). When everything talks and nothing asks, what is left is code, or else all of it.
    A question that stands alone is the whole ask, unless the turn is `material` the operator's task
    works on (a message to classify): then a question in it is part of the material."""
    split = [split_segments(line) if not is_code else [line] for line, is_code in zip(lines, code)]
    flagged = [[not is_code and talk(s) for s in segments] for segments, is_code in zip(split, code)]
    prose = [(s, mark) for segments, marks, is_code in zip(split, flagged, code) if not is_code for s, mark in zip(segments, marks)]
    # The questions; without one, the instructions (beside a question, "Answer like a professor." is talk)
    asked = {s for s, _ in prose if _QUESTION.search(s)} or {s for s, _ in prose if ASK.match(s)}
    if not material and len(asked) > 1:
        quoted = {s for segments, line, is_code in zip(split, lines, code)
                  if not is_code and line.lstrip().startswith(">") for s in segments}
        asked = _other_asks_dropped(asked, [s for s, _ in prose], quoted)
    questions = [s for s, mark in prose if s in asked and not mark]
    if not questions and asked:  # a question that talks is still asked
        questions = [s for s, mark in prose if s in asked or not mark]
    anchor_segments = set(questions or [s for s, mark in prose if not mark])
    if not anchor_segments:  # everything talks: code, if any, is the task, else the talk is all there is
        return [line for line, is_code in zip(lines, code) if is_code] or lines
    anchor = frozenset().union(*(content(s) for s in anchor_segments))
    # An instruction's material may follow it in any form; a question of one content word or none
    # ("How do I fix it?") points back at what it needs: beside those, only what talks goes.
    lenient = not any(_QUESTION.search(q) and len(content(q)) > 1 for q in set(questions))
    # A question that stands alone needs nothing it does not name: then prose beside it is read only
    # where the question refers to it (a shared token), it states a number, or a colon hands it on.
    alone_asks = {q for q in questions if q in asked}
    line_ends = {segments[-1] for segments, is_code in zip(split, code) if segments and not is_code}
    # an instruction's colon that hands on material, not the question ("... from this email:")
    hands_on = any(_LEAD_IN.search(s) and not mark and len(s.split()) > 3
                   and (s in line_ends or not after[:1].islower() and after not in alone_asks)
                   for (s, mark), (after, _) in zip(prose, prose[1:] + [("", False)]))
    alone = not material and not hands_on and bool(alone_asks) \
        and all(_QUESTION.search(q) and stands_alone(q) for q in alone_asks)
    if alone:  # then the question, even one that talks ("Which planet is the largest?"), is the whole ask
        anchor_segments = alone_asks
        anchor = frozenset().union(*(content(s) for s in anchor_segments))
    asked_tokens = frozenset().union(*(tokens(q) for q in anchor_segments))
    asks_numbers = any(_DIGIT.search(q) for q in anchor_segments)

    def kept(segment: str, mark: bool, introduced: bool) -> bool:
        if segment in anchor_segments:
            return True
        shared = len(content(segment) & anchor)
        if shared >= (1 if _DIGIT.search(segment) or not mark else 2):
            return True
        if alone and not mark:  # a number is a premise, unless the question names its own ("What is 568 - 385?")
            return bool(_DIGIT.search(segment) and not asks_numbers or tokens(segment) & asked_tokens or introduced)
        if lenient:
            return not mark
        # Beside a question, a sentence with two weak cues that shares nothing with it is talk whatever else
        # it says, and so is a fragment; a label of material that is kept stays. A sentence stating a
        # number may be a premise.
        score = 0.0 if _DIGIT.search(segment) else cues(segment)
        if _WH.search(segment):  # the first half of the question
            score = 0.0
        return not (mark or score >= 1 or (_fragment(segment) and not introduced))

    kept_lines = []
    premise, asked_yet = False, False  # whether the segment before was a kept premise; whether the question came
    for line, segments, marks, is_code in zip(lines, split, flagged, code):
        if is_code:
            kept_lines.append(line)
            continue
        keep: list[bool] = [False] * len(segments)
        for i in reversed(range(len(segments))):
            # beside a question that stands alone, a sentence a kept one points back at ("She bakes ...") is kept
            if alone and not marks[i] and i + 1 < len(segments) and keep[i + 1] and _points(segments[i + 1]):
                keep[i] = True
                continue
            label = bool(_LEAD_IN.search(segments[i])) and (len(segments[i].split()) <= 3 or alone)
            # a label of kept material stays ("Text: ..."), one of the question itself need not ("Question: ...")
            # ("Which is a mammal: cat, car or rock?" is one question cut at its colon)
            keep[i] = kept(segments[i], marks[i], label and i + 1 < len(segments) and keep[i + 1] and (
                segments[i + 1] not in anchor_segments or alone and not segments[i + 1][:1].isupper()))
            if label and i + 1 < len(segments) and keep[i + 1] and not keep[i] and len(segments[i + 1].split()) <= 3 \
                    and segments[i + 1] not in anchor_segments:
                keep[i + 1] = False  # "priority: P0": the value of a label that talks goes with it
            if label and i + 1 < len(segments) and not keep[i + 1]:
                keep[i] = False  # "cliente: premium": a label goes with the value it introduces
        if alone:  # the caller's own situation told in a few words just before the question ("My account got locked.")
            for i in range(len(segments) - 1):
                if segments[i + 1] in anchor_segments and not marks[i] and len(segments[i].split()) <= 8 \
                        and set(re.findall(r"[\w']+", fold(segments[i]))) & _FIRST_PERSON:
                    keep[i] = True
        if alone:  # and so is one before the question that points back at a kept premise ("She split the cost ...")
            for i, segment in enumerate(segments):
                asked_yet = asked_yet or segment in anchor_segments
                if not asked_yet and not keep[i] and not marks[i] and premise and _points(segment):
                    keep[i] = True
                premise = keep[i] and not asked_yet
        if all(keep):
            kept_lines.append(line)
        elif any(keep):
            kept_lines.append(joined([s for s, k in zip(segments, keep) if k]))
    return kept_lines


# What points outside a question, in the languages above: a pronoun or a demonstrative, a word that
# names given material. A question without one (and with a number or two content words) stands alone.
_POINTER = frozenset("""
it its this that these those they them their theirs he she him her his hers above below following former latter
previous aforementioned such same given provided passage text context document story paragraph snippet
excerpt according mentioned described stated
ce cet cette ces ceci cela ca il elle ils elles lui leur leurs celui celle ceux suivant suivante ci-dessus texte
esto eso este esta estos estas ese esa esos esas ello aquel aquella siguiente anterior texto ellos ellas dicho
isso isto esse essa esses essas aquilo seguinte acima ele ela eles elas dele dela
das dies diese dieser dieses diesen es er sie ihn ihm ihr ihre obige obigen folgende folgenden davon dazu
questo questa quello quella seguente sopra esso essa
""".split())
_FIRST_PERSON = frozenset("i i'd i'm i've my me mine je j'ai mon ma mes yo mi mis eu meu minha ich mein meine io mio mia".split())
_SHORT = frozenset("a i y e o u".split())  # one-letter words that are words, not a problem's names


@functools.lru_cache(maxsize=256)
def tokens(segment: str) -> frozenset[str]:
    """Every word of a segment that is not filler or a two-letter word, one-letter names and numbers
    included, cut to six letters."""
    return frozenset(w[:6] for w in re.findall(r"\w+", fold(segment))
                     if w not in _FILLER and (len(w) > 2 or _DIGIT.search(w) or len(w) == 1 and w not in _SHORT))


def _other_asks_dropped(asked: set[str], order: list[str], quoted: set[str]) -> set[str]:
    """Where several questions are asked, one in quoted lines ("> Can we move the retro?") is material
    while another is not; and where the last stands alone, one before it that talks and shares no word
    with it ("Which model am I talking to?") is not the ask."""
    asked = asked - quoted or asked
    last = next((s for s in reversed(order) if s in asked and _QUESTION.search(s)), None)
    if last is None or not stands_alone(last):
        return asked
    return {q for q in asked if q == last or not cues(q) or tokens(q) & tokens(last) or _DIGIT.search(q)}


def _points(segment: str) -> bool:
    return bool(set(re.findall(r"[\w-]+", fold(segment))) & _POINTER)


def stands_alone(question: str) -> bool:
    """A question that points at nothing outside it: no pronoun or demonstrative, no word naming given
    material, and what it asks about named (a number, or two content words)."""
    return not _points(question) and (bool(_DIGIT.search(question)) or _word_count(question) > 1)


def _fragment(segment: str) -> bool:
    return not _DIGIT.search(segment) and len(content(segment)) <= 1


_RULE = re.compile(r"^\s*([=\-_*+])\1{2,}|([=\-_*+])\2{2,}\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")


def unframed(text: str) -> str:
    """Outside code fences, a line that opens with a markup tag is read as the text between its tags,
    and rules of `===` or `---` around a line are not part of it: a metadata frame is not code."""
    out, fenced = [], False
    for line in text.split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            pieces = _TAG.sub("\n", line).split("\n") if _TAG.match(line.lstrip()) else [line]
            line = "\n".join(_RULE.sub("", piece).strip() if _RULE.search(piece) else piece for piece in pieces)
        out.append(line)
    return "\n".join(out)
