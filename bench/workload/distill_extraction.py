"""Phrase banks for the distillation traffic's extraction requests: the six JSON Schemas of the
workload (Acme's complaints and address changes, Inkwell's events and appointments, Forge's log
lines and invoices), each with its templates and a draw of gold values that its text states.
Dates come with the year in several spellings, counts in digits or words, fields in varying
order, with noise sentences and distractors (an old city, a previous employer, a subtotal) that
the text marks as not the answer.

Written by hand for this project, independently of the workload's hand-written items (the
evaluation split is held out: these texts train the model that is scored on it).
"""

from __future__ import annotations

import datetime as dt
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.workload.distill_words import CA_CITIES, CITIES, PRODUCTS, STREETS, US_CITIES, count_text, date_text, fill, person, random_date, spoken

Draw = Callable[[random.Random], tuple[dict[str, Any], dict[str, Any]]]  # -> (gold, slot values)


@dataclass(frozen=True)
class Schema:
    name: str
    tenant: str
    prompt: str
    schema: dict[str, Any]
    templates: tuple[str, ...]
    noise: tuple[str, ...]
    draw: Draw


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


STRING, INTEGER, NUMBER = {"type": "string"}, {"type": "integer"}, {"type": "number"}
DATE = {"type": "string", "description": "the date as YYYY-MM-DD"}
ISSUES = ["damaged", "missing", "late", "wrong_item"]
LEVELS = ["ERROR", "WARN", "INFO"]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CAD"]

# --- acme: complaints -----------------------------------------------------------------------------

ISSUE_PHRASES = {
    "damaged": ["arrived broken", "came with a crack running down one side", "was smashed to pieces inside the box",
                "turned up badly dented", "arrived with its glass panel shattered", "was torn along a seam when I opened it"],
    "missing": ["never arrived", "wasn't in the parcel when it came", "is marked as delivered but never reached me",
                "was left out of the package entirely", "was missing from the parcel"],
    "late": ["arrived {days} days after the promised date", "only showed up {days} days late",
             "finally came, but a full week after the delivery window", "got here long after the date you promised",
             "was delivered, though {days} days later than the confirmation said"],
    "wrong_item": ["turned out to be a {other} instead", "came in {colour} although I ordered {colour2}",
                   "was a different model from the one I paid for", "was not what I ordered: the box held a {other}",
                   "was swapped for someone else's {other}"],
}
REFUND_YES = ["I want a full refund.", "Please refund me.", "I expect my money back.",
              "Put the whole amount back on my card, please.", "Cancel it and give me a refund, please.",
              "A refund is the only thing that will sort this out.", "I'm requesting a refund."]
REFUND_NO = ["I'm not asking for a refund, I just want this on record.", "No refund needed.",
             "I don't want my money back.", "I'm not after a refund; I just thought you should know."]
REPLACE_NO = ["Please just send a replacement; no refund.", "Keep the money; I only want the right item.",
              "Could you send another one? I'd rather not get my money back."]
# A customer who asks for something else, or for nothing, asks for no refund without saying so. The first
# adapter marked such emails as refund requests (5 of its 11 extraction misses on the calibration and
# development splits), and the teacher's verified answers held 60 refunds to 23 others.
IMPLICIT_NO = ["Could you send the right one out to me?", "Can you exchange it?", "Please ship whatever is still owed.",
               "I'll keep it, I just wanted you to know.", "Just letting you know for next time.", "Please arrange a new delivery.",
               "Could you swap it when the courier is next in the area?", "Please post the rest when you can.",
               "Can someone call me to arrange an exchange?", "No need to do anything, it's fine otherwise."]


def _complaint(rng: random.Random) -> tuple[dict[str, Any], dict[str, Any]]:
    issue, refund = rng.choice(ISSUES), rng.random() < 0.5
    no = (REFUND_NO if issue == "late" else REFUND_NO + REPLACE_NO) + IMPLICIT_NO
    gold = {"order_id": f"A-{rng.randint(20000, 99999)}", "customer_name": person(rng), "issue": issue,
            "refund_requested": refund}
    slots = {"order": gold["order_id"], "name": gold["customer_name"],
             "issue": fill(rng.choice(ISSUE_PHRASES[issue]), rng, slots={"other": PRODUCTS}),
             "refund": rng.choice(REFUND_YES if refund else no)}
    return gold, slots


COMPLAINT = Schema(
    "complaint", "acme", "extract",
    _object({"order_id": STRING, "customer_name": STRING, "issue": {"type": "string", "enum": ISSUES},
             "refund_requested": {"type": "boolean"}}),
    ("Hi, my name is {name}. The {product} from order {order} {issue}. {refund}",
     "Order {order}: the {product} {issue}. {refund} {name}",
     "I'm writing about order {order}. The {product} {issue}, which is really frustrating. {refund} Thanks, {name}",
     "This is {name}, order {order}. {refund} The reason: the {product} {issue}.",
     "Dear Acme, {noise} Unfortunately the {product} in order number {order} {issue}. {refund} Kind regards, {name}",
     "{name} here. {noise} The {product} {issue}. Order reference {order}. {refund}",
     "Complaint from {name}: the {product} (order {order}) {issue}. {refund}",
     "Hello, I ordered a {product} under {order} and it {issue}. {refund} You can reach me at this address. {name}",
     "Good afternoon. {noise} My order, {order}, included a {product} that {issue}. {refund} Best, {name}",
     "{name} writing. I'm afraid the {product} {issue}. {refund} The order number is {order}.",
     "Regarding {order}: {refund} The {product} {issue}. {noise} Signed, {name}",
     "Not impressed. The {product} I ordered ({order}) {issue}. {refund} {name}, {city}"),
    ("I've shopped with you for years.", "This is the second time I've had to write in.",
     "I tried calling, but the line was busy.", "My son helped me place the order online.",
     "It was meant to be a housewarming gift.", "I usually have no complaints at all."),
    _complaint,
)

# --- acme: address changes ------------------------------------------------------------------------

_CA_LETTERS = "ABCEGHJKLMNPRSTVXY"
# A postal code that fits its city: a US ZIP's first three digits, a Canadian code's first letter.
POSTAL_STARTS = {"Tucson": "857", "Boise": "837", "Albany": "122", "Savannah": "314", "Duluth": "558", "Spokane": "992",
                 "Asheville": "288", "Madison": "537", "Eugene": "974", "Chattanooga": "374", "Lexington": "405",
                 "Santa Fe": "875", "Burlington": "054", "Fort Collins": "805", "Wichita": "672", "Des Moines": "503",
                 "Baton Rouge": "708", "Provo": "846", "Ann Arbor": "481", "Bangor": "044", "Halifax": "B",
                 "Kelowna": "V", "Saskatoon": "S", "Kingston": "K", "Victoria": "V", "Moncton": "E", "Lethbridge": "T",
                 "Sherbrooke": "J", "Thunder Bay": "P", "Charlottetown": "C"}


def _postal(rng: random.Random, city: str) -> str:
    start = POSTAL_STARTS[city]
    if start.isdigit():
        return f"{start}{rng.randint(0, 99):02d}"
    b, c = rng.choice(_CA_LETTERS), rng.choice(_CA_LETTERS)
    return f"{start}{rng.randint(0, 9)}{b} {rng.randint(0, 9)}{c}{rng.randint(0, 9)}"


def _address(rng: random.Random) -> tuple[dict[str, Any], dict[str, Any]]:
    canadian = rng.random() < 0.3
    city, region = rng.choice(CA_CITIES if canadian else US_CITIES)
    postal, street = _postal(rng, city), f"{rng.randint(2, 980)} {rng.choice(STREETS)}"
    gold = {"order_id": f"A-{rng.randint(20000, 99999)}", "city": city, "postal_code": postal}
    wrong = postal
    while wrong == postal:  # the correction's old code is another one
        wrong = _postal(rng, city)
    slots = {"order": gold["order_id"], "city": city, "postal": postal, "street": street, "region": region,
             "address": f"{street}, {city}, {region} {postal}", "wrong_postal": wrong}
    return gold, slots


ADDRESS = Schema(
    "address", "acme", "extract",
    _object({"order_id": STRING, "city": STRING, "postal_code": STRING}),
    ("Hi, I've moved. Please send order {order} to {address} instead.",
     "Could you update the delivery address for {order}? New address: {address}.",
     "Please reroute {order}. I'm now living at {address}.",
     "We're staying with family in {city} for the summer, so order {order} should go to {street}, postal code {postal}.",
     "Small correction on order {order}: the postal code should be {postal}, not {wrong_postal}. The city is {city}.",
     "Updated delivery details for {order}: {address}. {noise}",
     "I typed my old address by mistake. Order {order} needs to go to {address}.",
     "{name} here. I moved from {city2} to {city} last week; please ship {order} to {street}, {city} {postal}.",
     "Address update: {address}. Order: {order}.",
     "Can the driver bring order {order} to my office instead? It's at {address}.",
     "For order {order}, please use my new address in {city}: {street}, {region} {postal}. {noise}",
     "{noise} The order is {order}, and it should now go to {city}, {region} {postal}, {street}."),
    ("Thanks for sorting this out.", "The old address won't work any more.", "Sorry for the trouble.",
     "The buzzer is broken, so please ask the driver to knock.", "Nothing else on the order changes."),
    _address,
)

# --- inkwell: events ------------------------------------------------------------------------------


def _event(rng: random.Random) -> tuple[dict[str, Any], dict[str, Any]]:
    city, day = rng.choice(CITIES), random_date(rng)
    attendance = rng.choice([rng.randint(40, 900), rng.randint(9, 400) * 10, rng.randint(5, 60) * 1000 + rng.randint(0, 9) * 100])
    gold = {"city": city, "date": day.isoformat(), "attendance": attendance}
    return gold, {"city": city, "city_caps": city.upper(), "date": date_text(rng, day), "attendance": count_text(rng, attendance)}


EVENT = Schema(
    "event", "inkwell", "extract",
    _object({"city": STRING, "date": DATE, "attendance": INTEGER}),
    ("About {attendance} people attended the {event} in {city} on {date}.",
     "{city_caps} - A crowd of {attendance} turned out on {date} for the {event}, organisers said.",
     "The {event} drew {attendance} visitors to {city} on {date}. {noise}",
     "Police put the crowd at the {city} {event} on {date} at {attendance}.",
     "On {date}, {attendance} people packed the main square of {city} for the annual {event}. {noise}",
     "Organisers of the {event} in {city} counted {attendance} visitors on {date}, its busiest day so far.",
     "In {city}, the {event} on {date} welcomed {attendance} guests despite the rain.",
     "The {event} returned to {city} on {date}. Ticket sales put attendance at {attendance}.",
     "Held on {date} in {city}, the {event} attracted {attendance} people, according to the city's events office.",
     "{city} hosted the {event} on {date}; a total of {attendance} people came through the gates. {noise}",
     "{noise} Some {attendance} residents joined the {event} in {city} on {date}.",
     "{city_caps} ({date}) - Attendance at this year's {event} reached {attendance}."),
    ("Local bands played until late in the evening.", "A shuttle bus ran from the train station all day.",
     "Money raised will go to the food bank.", "Next year's edition is already being planned.",
     "Stallholders reported brisk trade.", "The weather held until the closing speeches."),
    _event,
)

# --- inkwell: appointments ------------------------------------------------------------------------

# Each organisation with the posts it would announce, so a hospital does not hire a conductor.
ORGANIZATIONS = {
    "Harbor Mutual": ["chief executive", "finance director", "head of claims"],
    "Crestline Bank": ["chief executive", "chief risk officer", "head of retail banking"],
    "Northfield General Hospital": ["medical director", "chief nursing officer", "head of cardiology"],
    "Bellwether Library Trust": ["director", "head of collections", "chief librarian"],
    "Eastbrook Symphony": ["principal conductor", "music director", "general manager"],
    "Kilnworth Ceramics": ["managing director", "head of design", "operations director"],
    "Rowan Valley Water Board": ["chair", "chief engineer", "chief executive"],
    "Sable Point Shipping": ["chief executive", "operations director", "fleet director"],
    "Meridian Housing Association": ["chief executive", "director of housing", "finance director"],
    "Thistledown Press": ["publisher", "editorial director", "managing editor"],
    "Aldgate Robotics": ["chief technology officer", "head of research", "chief executive"],
    "Fairhaven Museum of Art": ["chief curator", "director", "head of education"],
    "Corvid Analytics": ["chief data officer", "head of engineering", "chief executive"],
    "Westerly Rail": ["managing director", "safety director", "chief operating officer"],
}


def _appointment(rng: random.Random) -> tuple[dict[str, Any], dict[str, Any]]:
    year = rng.randint(2024, 2028)
    org = rng.choice(list(ORGANIZATIONS))
    gold = {"person": person(rng), "organization": org, "start_year": year}
    start = dt.date(year, rng.randint(1, 12), rng.randint(1, 28))
    slots = {"person": gold["person"], "org": gold["organization"], "year": year,
             "start": date_text(rng, start), "month": start.strftime("%B"), "tenure": spoken(rng.randint(3, 14)),
             "role": rng.choice(ORGANIZATIONS[org])}
    return gold, slots


APPOINTMENT = Schema(
    "appointment", "inkwell", "extract",
    _object({"person": STRING, "organization": STRING, "start_year": INTEGER}),
    ("{org} has appointed {person} as its new {role}, starting in {year}.",
     "{person} will become {role} of {org} in {year}, the organisation said on {weekday}.",
     "{person}, who previously worked at {org2}, joins {org} as {role} in {year}.",
     "In {year}, {person} takes over as {role} at {org}. {noise}",
     "{org} named {person} its {role}; the appointment takes effect in {year}.",
     "The board of {org} confirmed that {person} will serve as {role} from {month} {year}.",
     "{person} has been hired by {org}, and the new role as {role} begins in {year}.",
     "Starting in {year}, {person} will serve {org} as {role}, after a long search.",
     "{person} is set to join {org} in {year} as its {role}. {noise}",
     "Appointment: {person}, {role}, {org}, effective {start}.",
     "After {tenure} years at {org2}, {person} moves to {org} as {role} in {year}.",
     "{org} said {person} would start as {role} in {year}, replacing {person2}."),
    ("The post had been vacant since the spring.", "The search drew more than a hundred applicants.",
     "The announcement was made at the annual meeting.", "No salary details were released."),
    _appointment,
)

# --- forge: log lines -----------------------------------------------------------------------------

SERVICES = ["checkout-api", "auth-service", "billing-worker", "search-gateway", "image-resizer", "notifier",
            "inventory-sync", "edge-proxy", "profile-store", "report-builder", "ledger", "mailer"]
STATUSES = {"ERROR": [500, 502, 503, 504], "WARN": [400, 401, 403, 404, 409, 429], "INFO": [200, 201, 204, 301, 304]}
LEVEL_SPELLINGS = {"ERROR": ["ERROR", "error", "Error"], "WARN": ["WARN", "WARNING", "warn", "warning"], "INFO": ["INFO", "info"]}
LEVEL_WORDS = {"ERROR": "an error", "WARN": "a warning", "INFO": "an info"}
LOG_MESSAGES = {"ERROR": ["upstream timeout", "connection reset by peer", "unhandled exception", "database unavailable"],
                "WARN": ["rate limit reached", "token expired", "slow query", "payload too large", "retry scheduled"],
                "INFO": ["request served", "cache hit", "job completed", "session started"]}


def _log(rng: random.Random) -> tuple[dict[str, Any], dict[str, Any]]:
    level = rng.choice(LEVELS)
    ms: int | float = rng.randint(2, 9000) if rng.random() < 0.8 else rng.randint(10, 9999) / 10
    gold = {"service": rng.choice(SERVICES), "level": level, "status_code": rng.choice(STATUSES[level]), "duration_ms": ms}
    moment = dt.datetime.combine(random_date(rng), dt.time(rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59)))
    slots = {"service": gold["service"], "level": rng.choice(LEVEL_SPELLINGS[level]), "level_word": LEVEL_WORDS[level],
             "status": gold["status_code"], "ms": ms, "secs": f"{ms / 1000:g}",
             "ts": rng.choice([moment.isoformat() + "Z", moment.strftime("%Y-%m-%d %H:%M:%S"),
                               moment.strftime("%d/%b/%Y:%H:%M:%S")]),
             "pid": rng.randint(100, 65000), "req": f"{rng.getrandbits(32):08x}", "message": rng.choice(LOG_MESSAGES[level])}
    return gold, slots


LOG = Schema(
    "log", "forge", "extract",
    _object({"service": STRING, "level": {"type": "string", "enum": LEVELS}, "status_code": INTEGER, "duration_ms": NUMBER}),
    ("{ts} {level} [{service}] {method} {path} -> {status} in {ms}ms",
     "level={level} service={service} status={status} duration_ms={ms} path={path}",
     '{"ts": "{ts}", "level": "{level}", "svc": "{service}", "code": {status}, "took_ms": {ms}}',
     "[{level}] {ts} {service}: request {req} finished with HTTP {status} after {ms} ms",
     "{service} | {level} | status={status} | {ms}ms | {method} {path}",
     "Notice from {service}: {level} - upstream returned {status}, latency {ms} ms.",
     "{ts} {service}[{pid}] {level}: {method} {path} {status} ({secs}s)",
     "Can you parse this line from our logs? {ts} pid={pid} {service} {level} status_code={status} elapsed={ms}ms",
     "From the {service} logs at {ts}: {level_word} entry, status {status}, took {ms} milliseconds.",
     "{level} {ts} svc={service} rt={ms}ms st={status} {method} {path}",
     "{ts} [{service}] {level} {message} (status={status}, duration={ms}ms)",
     "{service} {ts} {level} req_id={req} {method} {path} status:{status} time:{ms}ms {message}"),
    (),
    _log,
)
LOG_SLOTS = {
    "method": ["GET", "POST", "PUT", "DELETE", "PATCH"],
    "path": ["/v1/orders", "/v2/cart/items", "/health", "/api/login", "/thumbs/large", "/v1/invoices/export",
             "/search", "/v1/users/me", "/webhooks/stripe", "/reports/daily"],
}

# --- forge: invoices ------------------------------------------------------------------------------

# Each vendor with what it bills for ("the hosting invoice from Bluepeak Hosting").
VENDORS = {"Bluepeak Hosting": "hosting", "Ferrous Cloud Ltd": "cloud compute", "Quillstone Print Co": "printing",
           "Oakridge Office Supply": "office supplies", "Tessellate Analytics GmbH": "consulting",
           "Marlow & Finch Legal": "legal fees", "Cobaltline Networks": "network maintenance",
           "Hearthside Catering": "catering", "Pallas Security Inc": "security audit",
           "Driftwood Design Studio": "design work", "Kestrel Courier Services": "courier", "Lumen Grid Ltd": "electricity"}
# Per currency, the ways an amount is written; {words} only for whole amounts.
MONEY = {
    "USD": ["${a}", "USD {a}", "{a} USD", "US${a}", "{words} US dollars"],
    "EUR": ["€{a}", "EUR {a}", "{a} euros", "{words} euros"],
    "GBP": ["£{a}", "GBP {a}", "{a} pounds sterling", "{words} pounds sterling"],
    "JPY": ["¥{a}", "JPY {a}", "{a} yen", "{words} yen"],
    "CAD": ["C${a}", "CAD {a}", "{a} Canadian dollars", "{words} Canadian dollars"],
}


def _money(currency: str, amount: float, form: str) -> str:
    if "{words}" in form:
        if amount == int(amount) and amount < 1_000_000:
            return form.replace("{words}", spoken(int(amount)))
        form = MONEY[currency][0]
    return form.replace("{a}", f"{int(amount):,}" if currency == "JPY" else f"{amount:,.2f}")


def _invoice(rng: random.Random) -> tuple[dict[str, Any], dict[str, Any]]:
    currency, due = rng.choice(CURRENCIES), random_date(rng)
    if currency == "JPY":
        total: float = rng.randint(500, 300_000) * 10
    else:
        total = rng.randint(40, 25_000) if rng.random() < 0.3 else rng.randint(4_000, 2_500_000) / 100
    year, letters = due.year, "".join(rng.choice(string.ascii_uppercase) for _ in range(2))
    number = rng.choice([f"INV-{year}-{rng.randint(1, 9999):04d}", f"{letters}-{rng.randint(10000, 99999)}",
                         f"{rng.randint(1000, 9999)}-{letters[0]}", f"{letters}{year % 100}{rng.randint(100, 999)}"])
    gold = {"vendor": rng.choice(list(VENDORS)), "invoice_number": number, "total": total, "currency": currency,
            "due_date": due.isoformat()}
    form = rng.choice(MONEY[currency])
    subtotal = round(total / 1.2) if currency == "JPY" else round(total / 1.2, 2)
    slots = {"vendor": gold["vendor"], "what": VENDORS[gold["vendor"]], "inv": number, "money": _money(currency, total, form), "date": date_text(rng, due),
             "subtotal": _money(currency, subtotal, MONEY[currency][0]),
             "tax": _money(currency, round(total - subtotal, 2), MONEY[currency][0]),
             "issued": date_text(rng, due - dt.timedelta(days=rng.choice([14, 30, 45])))}
    return gold, slots


INVOICE = Schema(
    "invoice", "forge", "extract",
    _object({"vendor": STRING, "invoice_number": STRING, "total": NUMBER, "currency": {"type": "string", "enum": CURRENCIES},
             "due_date": DATE}),
    ("Invoice {inv} from {vendor}. Amount due: {money}. Payment due by {date}.",
     "{vendor} - invoice no. {inv}, total {money}, due {date}.",
     "Hi team, {vendor} sent invoice {inv} for {money}; they want it paid by {date}. {noise}",
     "Please pay {vendor} {money} by {date} (ref: invoice {inv}).",
     "INVOICE\nVendor: {vendor}\nNumber: {inv}\nDue date: {date}\nTotal: {money}",
     "Reminder from {vendor}: invoice #{inv} ({money}) falls due on {date}.",
     "Forwarding the invoice from {vendor}, number {inv}. Subtotal {subtotal}, tax {tax}, total {money}. Due {date}.",
     "{vendor} billed us {money} on invoice {inv}, payable by {date}.",
     "Accounts payable: {inv} / {vendor} / {money} / due {date}",
     "The {what} invoice from {vendor} ({inv}) comes to {money} and must be settled by {date}.",
     "Can someone approve {vendor} invoice {inv}? It's {money}, due on {date}. {noise}",
     "Issued {issued} by {vendor}: invoice {inv}, {money}, payable by {date}."),
    ("Finance asked for approval before Friday.", "The PO is attached to the ticket.",
     "Same vendor as last quarter.", "Let me know if the amount looks off."),
    _invoice,
)

EXTRA_SLOTS: dict[str, dict[str, Any]] = {
    "complaint": {}, "address": {}, "event": {
        "event": ["harvest fair", "jazz festival", "book fair", "lantern parade", "charity run", "street food festival",
                  "science fair", "boat show", "folk festival", "kite festival", "vintage car rally"]},
    "appointment": {"org": list(ORGANIZATIONS), "person": person},  # {org2}, {person2}: other than the gold ones
    "log": LOG_SLOTS, "invoice": {},
}
SCHEMAS: tuple[Schema, ...] = (COMPLAINT, ADDRESS, EVENT, APPOINTMENT, LOG, INVOICE)


def text(rng: random.Random, schema: Schema) -> tuple[str, dict[str, Any]]:
    """One text for `schema` and the gold record it states."""
    gold, slots = schema.draw(rng)
    extra = {**EXTRA_SLOTS[schema.name], "noise": list(schema.noise) or [""]}
    body = fill(rng.choice(schema.templates), rng, fixed=slots, slots=extra)
    return re.sub(r" {2,}", " ", body).strip(), gold  # an empty noise slot leaves a double space
