"""Phrase banks for the distillation traffic's classification requests: Acme's customer messages
(triage), Inkwell's reader comments (sentiment) and headlines (topic). Each label has its own
templates, written so that the label is plain from the text alone; openers and closers wrap
the customer messages.

Written by hand for this project, independently of the workload's hand-written items (the
evaluation split is held out: these texts train the model that is scored on it).
"""

from __future__ import annotations

import random

from bench.workload.distill_words import fill, person

# (tenant, prompt) -> label -> templates
TEMPLATES: dict[tuple[str, str], dict[str, list[str]]] = {
    ("acme", "triage"): {
        "billing": [
            "You've billed me two times for one order, {amount} each, on my {card} card.",
            "My card statement shows a charge of {amount} from Acme that I don't recognise at all.",
            "Could you send me an invoice with our company's tax ID on it for order {order}? Our accountant needs it.",
            "The promo code {promo} was accepted at checkout, but the discount never made it onto the amount I was charged.",
            "How do I pay for one order with a gift card and my {card} card together?",
            "My payment keeps being declined at the last step, and my bank says the {card} card is fine.",
            "The student discount wasn't applied to my total. I paid {amount} instead of the discounted price.",
            "I need an itemised receipt showing the sales tax for order {order} for my expense claim.",
            "There's a pending authorisation of {amount} on my card for an order I cancelled straight away. "
            "When will that hold be released?",
            "Can I split the payment for order {order} across two different cards?",
            "We're a tax-exempt charity but were charged sales tax on our last purchase. Please correct the invoice.",
            "Why does my bank show {amount} from you when the order confirmation said a lower total?",
        ],
        "shipping": [
            "My order {order} was due to arrive on {weekday}, and its tracking status has been frozen for four days.",
            "The tracking number you sent still says 'label created', and nothing has moved since {weekday}.",
            "Do you deliver to {ca_city}? I couldn't find Canada among the delivery options.",
            "Your driver dropped my package at a house three doors down; the delivery photo shows a red door, and mine is green.",
            "I need the {product} by {weekday} for a birthday. Can you send it express to {us_city}?",
            "How many days does standard delivery usually take to {us_city}?",
            "My delivery was rescheduled again and I won't be home that day. Can the driver leave it with a neighbour?",
            "I placed order {order} three days ago and still haven't had a shipping confirmation.",
            "Only one of my two boxes was delivered. Tracking shows the other one sitting at a depot near {us_city}.",
            "Does your warehouse send out parcels on Saturdays? I ordered a {product} late on Friday.",
            "The driver marked order {order} as 'attempted delivery', but I was at home all day.",
            "Which carrier handles deliveries to {ca_city}, and can I pick the parcel up from their office?",
        ],
        "returns": [
            "I'd like to return the {product} I bought last week; it doesn't fit in my {room}.",
            "How do I print a return label for order {order}?",
            "I posted a {product} back to you two weeks ago. Has the returns centre received it yet?",
            "Can I exchange the {colour} {product} for the same one in {colour2}?",
            "I threw away the original box. Can I still send the {product} back?",
            "Is a {product} bought in the sale still returnable after ten days?",
            "I've changed my mind about the {product}; it's still sealed. What's the process for sending it back?",
            "Do I have to pay the return postage if the {product} simply isn't what I expected?",
            "My return was turned down because the {product} was 'used', but I only took it out of the packaging.",
            "Can I drop a return off somewhere local instead of mailing it all the way to the returns centre?",
            "The {product} I ordered is a size too big. I want to swap it for the smaller one.",
            "What's the deadline for sending back a {product} I haven't used?",
        ],
        "account": [
            "I can't sign in to my account. It says my password is wrong even though I just reset it.",
            "I'd like my login email switched from {email} to {email2}.",
            "How do I close my Acme account and remove my saved details?",
            "I want to stop the marketing newsletters but keep my account open.",
            "Someone changed the phone number on my profile without my permission. Can you lock my account?",
            "I never received the verification email for my new account, so I can't finish signing up.",
            "Can I add my partner {first2} as a second user on our household account?",
            "I got married, so I'd like the name on my account changed to {name}.",
            "My account was locked after too many sign-in attempts. How long before I can try again?",
            "How do I turn on two-step verification for my account?",
            "I registered a business account last month, but my profile still shows it as a personal one.",
            "I have two accounts under {email} and {email2}. Can you merge them into one?",
        ],
        "technical": [
            "The checkout page freezes when I press 'Place order' in {browser}.",
            "Your app shuts down the moment I tap my wish list on my {phone}.",
            "Product photos won't load on the website; all I see are grey boxes.",
            "The search bar returns nothing at all, even when I type '{product}'.",
            "The colour filter on the {category} page resets every time I scroll down.",
            "I get an 'error 500' page whenever I open the {category} section of the site.",
            "The smart {device} I bought from you won't pair with the Acme Home app over Bluetooth.",
            "The 'Add to cart' button does nothing in {browser}, although it works in {browser2}.",
            "Since the latest app update, every notification arrives twice on my {phone}.",
            "Your site gets stuck in a redirect loop when I open it in {browser}.",
            "The smart {device} from your store keeps dropping off my Wi-Fi network every few hours.",
            "The product videos play without any sound in the app on my {phone}.",
        ],
    },
    ("inkwell", "sentiment"): {
        "positive": [
            "What a lovely piece about {topic}. {writer} really captured how it feels.",
            "Thank you for covering {topic}; this is exactly the reporting our town needs.",
            "Best article I've read all week. The photos of {topic} made my morning.",
            "I was doubtful about {topic}, but this story changed my mind in the best way.",
            "{writer}'s piece on {topic} was a joy to read, and I've shared it with the whole family.",
            "So glad to finally see {topic} get the attention it deserves. Well done!",
            "This made me proud to live in {city}. Wonderful story about {topic}.",
            "Brilliant, balanced coverage of {topic}. Keep it up, Inkwell.",
            "Finally some good news! Huge thanks to everyone behind {topic}.",
            "Beautifully written. {writer} has a real gift for local stories like this one about {topic}.",
            "Delighted to read this. {topic_cap} is the best thing to happen here in years.",
        ],
        "negative": [
            "This article about {topic} is one-sided and lazy. Very disappointing.",
            "I can't believe you printed this. {writer} clearly didn't speak to anyone affected by {topic}.",
            "Another sloppy story about {topic}, full of mistakes. This paper used to be better.",
            "Misleading headline, misleading photos, and not one fact checked about {topic}.",
            "I'm cancelling my subscription after this piece on {topic}.",
            "What a waste of a front page. Nobody in {city} wants {topic} spun like this.",
            "The coverage of {topic} was insulting to the volunteers who did the actual work.",
            "Awful. {writer} should be embarrassed to have their name on this article.",
            "Clickbait again. You buried the real story about {topic} under three paragraphs of fluff.",
            "This made me angry. The people of {city} deserve honest reporting, not this rubbish.",
            "Poorly researched and badly written; I gave up halfway through the piece on {topic}.",
        ],
        "neutral": [
            "Does anyone know what time the public meeting about {topic} starts?",
            "The article says work on {topic} begins in {month}. Is that for the whole project?",
            "For readers asking: the map of {topic} is on page four of the print edition.",
            "I read the piece about {topic} on the bus this morning.",
            "Is there a link to the report on {topic} mentioned in the third paragraph?",
            "My neighbour in {city} mentioned this article about {topic}, so I looked it up.",
            "Will there be a follow-up on {topic} next week?",
            "The meeting mentioned here is listed for {weekday} on the {city} council website.",
            "Which photographer took the pictures for the story on {topic}?",
            "I live near the area in the story about {topic} and have seen the trucks there since {month}.",
            "Did the radio cover {topic} yesterday too, or was that a different story?",
            "Note for other readers: the print version of this story about {topic} ran on {weekday}.",
        ],
    },
    ("inkwell", "topic"): {
        "sports": [
            "{team} beat {team2} {score} to reach the cup final",
            "{athlete} sets national record in the {distance} at {city} meet",
            "{team} sign striker {athlete} on three-year contract",
            "Late penalty lifts {team} past {team2}",
            "{city} marathon draws record field of runners",
            "Coach {surname} steps down after {team} are relegated",
            "{athlete} wins first Grand Slam title in five sets",
            "Rain delays final stage of {city} cycling race",
            "{team} goalkeeper out for the season with knee injury",
            "Underdogs {team} stun champions {team2} in extra time",
            "Swimmer {athlete} qualifies for world championships in {distance}",
        ],
        "politics": [
            "{city} council votes to expand bus lanes after heated debate",
            "Senator {person} announces bid for governor",
            "Parliament passes bill on {policy}",
            "Mayor of {city} faces recall vote over housing plan",
            "Opposition leader {person} calls for snap election",
            "Voters in {city} head to the polls in tight mayoral race",
            "Cabinet reshuffle: {person} named new foreign minister",
            "Lawmakers clash over {policy} as session nears its end",
            "Governor vetoes {policy} bill passed by state legislature",
            "Turnout hits record high in {city} regional election",
            "Prime minister meets {country} leader for border treaty talks",
        ],
        "science": [
            "Astronomers spot {adjective} exoplanet orbiting nearby star",
            "Researchers at {university} map the genome of the {animal}",
            "New species of {new_animal} discovered in {place}",
            "Study finds the {animal} can recognise individual human faces",
            "Space probe sends first close-up images of {moon}",
            "Physicists at {university} report record-long quantum memory",
            "Fossil of giant {animal} ancestor unearthed in {place}",
            "Ocean sensors show the {sea} warming faster than expected",
            "Telescope captures birth of a star cluster {light_years} light-years away",
            "{university} team grows miniature liver tissue in the lab",
            "Volcanologists warn of rising gas levels at {volcano}",
        ],
        "business": [
            "{company} shares jump after profits beat forecasts",
            "{company} to buy rival {company2} in {deal} deal",
            "{company} cuts {many} jobs as sales slow",
            "Rate-setters keep borrowing costs unchanged at {rate}%",
            "{company} opens new factory in {city}, creating {many} jobs",
            "Retail sales fall in {month} for third month running",
            "{company} chief executive {person} to step down in spring",
            "Oil prices climb {rate}% on supply worries",
            "{company} recalls {many} electric scooters over battery fault",
            "Start-up {company} raises {deal} to expand delivery service",
            "{company} posts first quarterly loss in a decade",
        ],
        "culture": [
            "{artist} returns with first album in six years",
            "{city} museum reopens with exhibition of {style} paintings",
            "Debut novel by {person} wins this year's {prize} Prize",
            "Film festival in {city} opens with {person}'s first feature",
            "Orchestra plays farewell concert in historic {city} hall",
            "Street artists turn {city} underpass into open-air gallery",
            "Theatre revival of '{play}' sells out in a week",
            "Poet {person} named {city}'s first laureate",
            "Ballet company tours {country} for the first time",
            "Lost opera score found in {city} library attic",
            "Documentary on {city}'s jazz scene premieres to standing ovation",
        ],
    },
}

# Customer messages come with a greeting and a sign-off, or without; none of these leans to a label.
OPENERS = ["", "", "Hi,", "Hello there.", "Good morning,", "Hey Acme team,", "Hi support,", "Quick question.",
           "Hello, hoping you can help.", "Dear Acme,", "Good afternoon.", "Hi again,"]
CLOSERS = ["", "", "Thanks.", "Thanks in advance!", "Regards, {first}", "Cheers, {first}", "Please get back to me soon.",
           "Appreciate the help.", "Many thanks, {name}", "Thank you, {first}", "- {first}", "Best wishes, {name}"]

SLOTS = {
    "card": ["Visa", "Mastercard", "debit", "credit", "Amex"],
    "promo": lambda rng: rng.choice(["SPRING", "HOME", "WELCOME", "COZY", "FALL"]) + str(rng.randint(10, 40)),
    "ca_city": ["Halifax", "Kelowna", "Saskatoon", "Moncton", "Lethbridge", "Thunder Bay", "Charlottetown"],
    "room": ["hallway", "kitchen", "studio flat", "spare room", "bedroom", "living room"],
    "email": lambda rng: f"{rng.choice(['j', 'm', 'k', 'r', 's', 't'])}.{rng.choice(['fox', 'lane', 'reed', 'moss', 'vale'])}"
                         f"{rng.randint(1, 99)}@{rng.choice(['mailbox.example', 'post.example', 'inbox.example'])}",
    "browser": ["Firefox", "Safari", "Chrome", "Edge"],
    "phone": ["iPhone", "Android phone", "Pixel", "Galaxy tablet", "iPad"],
    "device": ["plug", "thermostat", "light bulb", "kettle", "smoke alarm", "doorbell"],
    "category": ["bedding", "kitchen", "lighting", "garden", "storage", "bathroom"],
    "writer": person, "athlete": person, "person": person,
    "topic_cap": lambda rng: rng.choice(["The new bike lanes", "The community garden", "The river festival",
                                         "The tram extension", "The night market", "The swimming pool reopening"]),
    "score": lambda rng: f"{rng.randint(2, 5)}-{rng.randint(0, 1)}",
    "distance": ["100 metres", "400 metres", "1500 metres", "5000 metres", "200m butterfly", "400m freestyle"],
    "policy": ["rent controls", "water rights", "school funding", "police oversight", "voting by mail", "data privacy"],
    "country": ["Norway", "Chile", "Ghana", "Vietnam", "Portugal", "Canada", "Kenya", "Uruguay"],
    "adjective": ["rocky", "water-rich", "Earth-sized", "scorching", "ice-covered"],
    "university": ["Eastmoor University", "the Lakeside Institute", "Northbay Technical University",
                   "Greywater College", "the University of Caldwick"],
    "animal": ["axolotl", "octopus", "honeybee", "pangolin", "sea turtle", "tree frog", "barn owl", "jumping spider"],
    "new_animal": ["tree frog", "jumping spider", "gecko", "orchid bee", "catfish", "dung beetle"],
    "place": ["Borneo", "the Andes", "Madagascar", "Patagonia", "the Gobi Desert", "Tasmania"],
    "moon": ["Europa", "Enceladus", "Titan", "Ganymede", "Triton"],
    "sea": ["Baltic Sea", "Arctic Ocean", "Coral Sea", "North Atlantic", "Mediterranean"],
    "light_years": lambda rng: f"{rng.randint(2, 90) * 100:,}",
    "volcano": ["Mount Kereth", "Ardnoch Peak", "Cerro Blanco Viejo", "Mount Sawtell"],
    "deal": lambda rng: f"${rng.randint(2, 95) / 10:.1f}bn" if rng.random() < 0.5 else f"${rng.randint(40, 900)}m",
    "many": lambda rng: f"{rng.randint(2, 60) * 50:,}",
    "rate": lambda rng: f"{rng.randint(1, 9)}.{rng.randint(0, 9)}",
    "artist": ["Singer Mara Quell", "Band The Lantern Choir", "Rapper K. Dorsett", "Folk duo Hollis & Vane",
               "Composer Ilse Varga", "Songwriter Tobias Wren"],
    "style": ["Flemish", "Impressionist", "Bauhaus", "folk-art", "Cubist", "Nordic landscape"],
    "prize": ["Halloway", "Greenmantle", "Ashcombe", "Silver Quill"],
    "play": ["The Glass Orchard", "Harbour Lights", "A Winter Ledger", "The Lamplighter's Daughter"],
}


def text(rng: random.Random, tenant: str, prompt: str, label: str) -> str:
    """One message of `label` for the tenant's prompt: a template with its slots filled, and for
    customer messages an opener and a closer."""
    body = fill(rng.choice(TEMPLATES[(tenant, prompt)][label]), rng, slots=SLOTS)
    if (tenant, prompt) != ("acme", "triage"):
        return body
    opener, closer = (fill(rng.choice(bank), rng, slots=SLOTS) for bank in (OPENERS, CLOSERS))
    message = body
    if opener:  # "Hi," stands on a line of its own, "Quick question." runs on
        message = opener + ("\n" if opener.endswith(",") else " ") + message
    if closer:  # a signed closer ("Regards, Ana") goes on its own line
        message = message + ("\n" if "," in closer or "- " in closer else " ") + closer
    return message
