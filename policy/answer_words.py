"""The closed classes of English words the near-miss guards (policy/answer_guards.py) read: numbers,
dates, negators, quantifiers, opposites, stop words, units. General lists, not words fitted to any
labelled pair."""

from __future__ import annotations

NUMBER_WORDS = {
    "zero": "0", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6", "seven": "7", "eight": "8", "nine": "9",
    "ten": "10", "eleven": "11", "twelve": "12", "thirteen": "13", "fourteen": "14", "fifteen": "15", "sixteen": "16",
    "seventeen": "17", "eighteen": "18", "nineteen": "19", "twenty": "20", "thirty": "30", "forty": "40", "fifty": "50",
    "sixty": "60", "seventy": "70", "eighty": "80", "ninety": "90", "hundred": "100", "thousand": "1000",
    "million": "1000000", "billion": "1000000000", "trillion": "1000000000000", "dozen": "12", "half": "1/2",
    "quarter": "1/4", "double": "x2", "twice": "x2", "triple": "x3", "thrice": "x3",
    "second": "2nd", "third": "3rd", "fourth": "4th", "fifth": "5th", "sixth": "6th", "seventh": "7th", "eighth": "8th",
    "ninth": "9th", "tenth": "10th",
}  # not "one", "first", "last": as often "a", a pronoun or an adverb as a number
DATE_WORDS = {
    "january", "february", "march", "april", "june", "july", "august", "september", "october", "november", "december",
    "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec",
    "monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday", "weekend", "weekday",
    "today", "tomorrow", "yesterday", "tonight", "morning", "afternoon", "evening", "night", "noon", "midnight",
    "summer", "autumn", "winter",
    "century", "decade", "ago", "previous", "upcoming",
    "a.m.", "p.m.",  # beside a number (words() spells "8 pm" so): "8 am" is not "8 pm"
}  # not "may", "fall", "spring", "second": common words first
NEGATORS = {
    "not", "no", "never", "without", "none", "nobody", "nothing", "neither", "nor", "nowhere", "cannot", "non",
    "lack", "lacking", "except", "excluding", "unable", "fail", "fails", "failed", "instead", "avoid", "prevent",
    "dont", "doesnt", "didnt", "isnt", "arent", "wasnt", "werent", "wont", "wouldnt", "shouldnt", "couldnt", "cant",
    "hasnt", "havent", "hadnt", "mustnt",
    "unless",  # if not
    "hardly", "barely", "scarcely",
}
# Verbs that negate the -ing verb after them: "show hidden files" / "stop showing hidden files" (alone,
# "stop hiccups" is "get rid of hiccups").
ENDING_VERBS = {"stop", "quit", "cease"}
# A time relation one side adds ("on the day" / "the day after") unless the other says it its way ("once").
TIME_RELATIONS = {"before", "after", "since", "until", "till"}
TIME_RELATION_WORDS = TIME_RELATIONS | {"once", "when", "past", "passed", "prior", "later", "earlier", "following", "within"}
NEGATING_PREFIXES = ("non", "un", "in", "im", "ir", "il", "dis", "anti", "de", "mis")
# Who or how much a question is about: one side having one the other lacks asks about another scope.
QUANTIFIERS = {
    "all", "every", "each", "some", "most", "least", "only", "both", "either", "few", "fewer", "more", "less",
    "several", "always", "entire", "whole", "partial", "partly", "best", "worst", "better", "worse", "max", "min",
    "maximum", "minimum",
}
SAME_QUANTIFIER = {"every": "all", "each": "all", "entire": "whole"}
# Opposites in everyday questions. A pair is flagged when one side has one word and the other its
# opposite, wherever they stand (a reworded question keeps its side of each pair).
OPPOSITES = """
good/bad good/evil better/worse best/worst right/wrong correct/wrong correct/incorrect true/false real/fake
positive/negative pros/cons advantages/disadvantages benefits/risks benefits/drawbacks benefits/dangers
strengths/weaknesses safe/dangerous safe/unsafe safe/risky healthy/unhealthy healthy/sick healthy/harmful well/ill
legal/illegal valid/invalid possible/impossible likely/unlikely able/unable known/unknown visible/invisible
hot/cold warm/cool warm/cold wet/dry damp/dry moist/dry light/dark bright/dark bright/dim light/heavy
hard/soft hard/easy difficult/easy simple/complicated simple/complex rough/smooth sharp/blunt sharp/dull
big/small large/small little/big long/short tall/short high/low wide/narrow broad/narrow thick/thin deep/shallow
fat/thin fat/lean full/empty full/hungry dense/sparse loose/tight tighten/loosen fast/slow quick/slow rapid/slow
early/late new/old young/old modern/ancient fresh/stale fresh/old ripe/unripe raw/cooked fresh/frozen
rich/poor wealthy/poor expensive/cheap costly/cheap free/paid strong/weak powerful/weak loud/quiet noisy/quiet
clean/dirty neat/messy open/closed open/close open/shut start/stop start/finish start/end begin/end beginning/end
first/last before/after past/future above/below over/under up/down upstairs/downstairs in/out inside/outside
internal/external interior/exterior inner/outer on/off front/back top/bottom upper/lower left/right forward/backward
ahead/behind near/far close/far north/south east/west horizontal/vertical even/odd singular/plural
increase/decrease increase/reduce raise/lower rise/fall rise/drop grow/shrink expand/shrink expand/contract
gain/lose gain/loss win/lose victory/defeat profit/loss more/less more/fewer most/least max/min maximum/minimum
many/few plus/minus add/remove add/subtract multiply/divide add/delete include/exclude include/omit combine/separate
join/separate join/leave attach/detach connect/disconnect buy/sell buying/selling import/export send/receive
give/take give/receive full/part lend/borrow spend/save save/waste save/delete deposit/withdraw credit/debit asset/liability
upload/download push/pull install/uninstall enable/disable lock/unlock encrypt/decrypt encode/decode
compress/decompress compress/extract zip/unzip mount/unmount follow/unfollow subscribe/unsubscribe login/logout
accept/reject accept/decline accept/refuse allow/deny allow/block allow/forbid allowed/forbidden permit/forbid
show/hide reveal/conceal remember/forget find/lose found/lost keep/lose keep/discard obey/disobey
lead/follow teach/learn hire/fire employ/fire punish/reward praise/blame praise/criticize help/hurt heal/hurt
attack/defend offense/defense war/peace friend/enemy hero/villain love/hate like/hate like/dislike agree/disagree
happy/sad glad/sorry laugh/cry joy/sorrow hope/fear calm/anxious confident/nervous polite/rude kind/cruel
generous/selfish honest/dishonest patient/impatient brave/cowardly wise/foolish smart/stupid clever/stupid
guilty/innocent success/failure succeed/fail pass/fail hit/miss always/never often/rarely often/seldom
frequent/rare common/rare usual/unusual normal/unusual normal/abnormal typical/unusual same/different
similar/different equal/unequal all/none all/some some/none everyone/nobody everything/nothing
arrive/depart arrive/leave arrival/departure enter/exit entrance/exit come/go stay/leave float/sink
input/output inbound/outbound incoming/outgoing ascending/descending asc/desc male/female men/women man/woman
boys/girls boy/girl kid/adult kids/adults husband/wife father/mother son/daughter brother/sister king/queen adult/child
adults/children parent/child senior/junior single/married day/night sunrise/sunset morning/evening morning/night
summer/winter spring/autumn birth/death born/died live/die alive/dead asleep/awake sleep/wake sunny/cloudy
public/private local/remote online/offline client/server frontend/backend read/write reading/writing
problem/solution cause/effect causes/effects present/absent wild/tame wild/domestic
permanent/temporary natural/artificial organic/synthetic sweet/sour sweet/salty sweet/bitter acidic/alkaline
freeze/thaw melt/freeze inhale/exhale maximize/minimize overestimate/underestimate overweight/underweight
upstream/downstream upgrade/downgrade uppercase/lowercase major/minor majority/minority rural/urban
domestic/international domestic/foreign superior/inferior optimistic/pessimistic mature/immature
vacant/occupied busy/free valuable/worthless build/destroy create/destroy break/fix
grant/deny grant/revoke approve/reject approve/deny exempt/subject overdue/paid
"""
# Prefixes that make opposites of the same stem: underpay / overpay, inflow / outflow.
OPPOSITE_PREFIXES = (("under", "over"), ("over", "under"), ("in", "out"), ("out", "in"))
STOP = set("""
ok okay most- a an the is are was were be been being am do does did doing done have has had having i me my mine myself you your
yours yourself we us our ours they them their theirs it its itself he him his she her hers this that these those
there here what whats which who whom whose how why when where whether if so as at by of in on to for from with about
into onto than then too also very just really actually exactly simply basically please can could would should will
shall may might must tell explain describe define show give let know want need like get gets got getting go goes
make makes making made take takes took way ways method methods thing things something anything anyone someone
somebody one ones any kind sort tips tip idea ideas and or but between im ive id youre theyre weve thats theres whos
s d ll re ve m t
""".split())
TIME_UNITS = {"second", "minute", "hour", "day", "night", "week", "month", "year"}
PERIODIC = {"hourly": "hour", "daily": "day", "nightly": "night", "weekly": "week", "monthly": "month", "yearly": "year",
             "annual": "year", "annually": "year"}
SCAFFOLD_BEFORE = {"way", "ways", "method", "methods", "approach", "option", "options", "practice", "practices"}
TECH = {
    "python", "java", "javascript", "typescript", "rust", "go", "golang", "ruby", "php", "perl", "swift", "kotlin",
    "scala", "haskell", "elixir", "erlang", "clojure", "lua", "julia", "matlab", "r", "c", "sql", "bash", "zsh",
    "powershell", "html", "css", "react", "vue", "angular", "svelte", "django", "flask", "fastapi", "rails", "spring",
    "node", "deno", "linux", "windows", "macos", "mac", "ios", "android", "ubuntu", "debian", "docker", "kubernetes",
    "postgres", "postgresql", "mysql", "sqlite", "mongodb", "redis", "git", "aws", "azure", "gcp", "excel", "numpy",
    "pandas", "pytorch", "tensorflow", "chrome", "firefox", "safari", "iphone", "ipad",
}
# Words that give a direction: "dollars to euros" is not "euros to dollars" ("and", "or", "vs" do not).
CONNECTORS = {"to", "from", "into", "over", "than", "before", "after", "against", "in"}
UNITS = {
    "cm": "centimeter", "mm": "millimeter", "km": "kilometer", "m": "meter", "kg": "kilogram", "g": "gram",
    "mg": "milligram", "lb": "pound", "lbs": "pound", "oz": "ounce", "ft": "foot", "feet": "foot", "in": "inch",
    "mi": "mile", "l": "liter", "ml": "milliliter", "litre": "liter", "metre": "meter", "kph": "kilometer",
    "mph": "mile", "hr": "hour", "hrs": "hour", "min": "minute", "mins": "minute", "sec": "second", "secs": "second",
    "gb": "gigabyte", "mb": "megabyte", "kb": "kilobyte", "tb": "terabyte", "js": "javascript", "ts": "typescript",
    "py": "python", "db": "database", "us": "usa", "uk": "britain", "pc": "computer", "tv": "television",
}
UNITS_BESIDE_NUMBERS = {"in", "us", "min", "sec", "second", "m", "g", "l", "mi", "db", "ts", "py"}  # common words elsewhere
VOWELS = set("aeiouy")
KEYBOARD = ["qwertyuiop", "asdfghjkl", "zxcvbnm"]

# Which time a question means: "this year" is not "last year" ("last" alone is as often "the latest").
RELATIVE_TIME = {"this", "last", "next", "past", "coming", "current", "previous", "following"}
TIME_SPANS = {"second", "minute", "hour", "day", "night", "week", "weekend", "month", "quarter", "semester", "term",
              "season", "year", "decade", "century", "morning", "afternoon", "evening", "spring", "summer", "fall",
              "autumn", "winter", "monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"}
# Measures: one side's miles are not the other's kilometers, and "F in C" is not "C in F".
MEASURES = {"centimeter", "millimeter", "kilometer", "meter", "kilogram", "gram", "milligram", "pound", "ounce", "foot",
            "inch", "mile", "yard", "liter", "milliliter", "gallon", "quart", "pint", "tablespoon", "teaspoon",
            "gigabyte", "megabyte", "kilobyte", "terabyte", "celsius", "fahrenheit", "kelvin", "acre", "hectare",
            "calorie", "kilocalorie", "watt", "kilowatt", "volt", "amp", "hertz"}
# Courtesy that asks nothing: "Thanks in advance, how do I ..." is "How do I ...".
COURTESY = r"\b(?:thanks|thank you|many thanks)(?: so much| a lot| in advance)?\b|\bquick question\b"
