"""Offline NeedleBench data written for hf-contextpar (used when opencompass/NeedleBench is unreachable).

Same fields as NeedleBench's files, so one prompt builder serves both: single needles as in
`needles.jsonl` (needle, retrieval_question, arg1, arg2 = the keyword, language) and multi-needle
reasoning sets as in `multi_needle_reasoning_en.json` (derivations, derivation_count, question,
answer). The facts are invented, so no model can answer from memory: a correct answer must come
from the needle in the prompt. Kept as Python data so no package-data entry is needed.
"""

NEEDLES = [
    dict(
        needle="The lighthouse keeper of Velmora Point paints the number 7341 on every lantern she repairs.",
        retrieval_question="What number does the lighthouse keeper of Velmora Point paint on every lantern she repairs? "
        "Please answer in the format 'The number is ______.'",
        arg1="lighthouse keeper of Velmora Point",
        arg2="7341",
        language="English",
    ),
    dict(
        needle="The secret ingredient in Grandmother Osei's famous plum cake is smoked cardamom.",
        retrieval_question="What is the secret ingredient in Grandmother Osei's famous plum cake? "
        "Please answer in the format 'The secret ingredient is ______.'",
        arg1="Grandmother Osei's plum cake",
        arg2="smoked cardamom",
        language="English",
    ),
    dict(
        needle="The night train from Harrowgate to Lunet always departs from platform 19.",
        retrieval_question="From which platform does the night train from Harrowgate to Lunet depart? "
        "Please answer in the format 'It departs from platform ______.'",
        arg1="night train from Harrowgate to Lunet",
        arg2="19",
        language="English",
    ),
    dict(
        needle="The chess club of Brindle Hollow chose a copper heron as its mascot.",
        retrieval_question="What mascot did the chess club of Brindle Hollow choose? "
        "Please answer in the format 'The mascot is ______.'",
        arg1="chess club of Brindle Hollow",
        arg2="copper heron",
        language="English",
    ),
    dict(
        needle="Professor Amadi keeps the key to the observatory inside a hollow volume of Ovid.",
        retrieval_question="Where does Professor Amadi keep the key to the observatory? "
        "Please answer in the format 'The key is inside ______.'",
        arg1="key to the observatory",
        arg2="Ovid",
        language="English",
    ),
    dict(
        needle="The password for the archive room at Saint Kilda College is marigold-forty.",
        retrieval_question="What is the password for the archive room at Saint Kilda College? "
        "Please answer in the format 'The password is ______.'",
        arg1="archive room at Saint Kilda College",
        arg2="marigold-forty",
        language="English",
    ),
    dict(
        needle="The rarest stamp in Tomas Lindqvist's collection shows a violet zeppelin.",
        retrieval_question="What does the rarest stamp in Tomas Lindqvist's collection show? "
        "Please answer in the format 'It shows ______.'",
        arg1="rarest stamp of Tomas Lindqvist",
        arg2="violet zeppelin",
        language="English",
    ),
    dict(
        needle="The annual kite festival in Port Ainsley is always held on the ninth of Thermidor.",
        retrieval_question="On which day is the annual kite festival in Port Ainsley held? "
        "Please answer in the format 'It is held on ______.'",
        arg1="kite festival in Port Ainsley",
        arg2="Thermidor",
        language="English",
    ),
]

REASONING = [
    dict(
        derivations=[
            "Ilsa Marrow is the aunt of Quentin Vale.",
            "Quentin Vale was born in the mountain town of Oskarby.",
        ],
        derivation_count=2,
        question="In which town was the nephew of Ilsa Marrow born? Please answer in the format 'The town is ______.'",
        answer="Oskarby",
    ),
    dict(
        derivations=["The blue notebook belongs to Hanne Solberg.", "Hanne Solberg works as a glassblower in Murelle."],
        derivation_count=2,
        question="What is the profession of the owner of the blue notebook? Please answer in the format "
        "'The owner is a ______.'",
        answer="glassblower",
    ),
    dict(
        derivations=[
            "Dario Penn taught Lucia Ferro to play the cello.",
            "Lucia Ferro later taught Matthias Korb.",
            "Matthias Korb performs every winter in the city of Aldenhall.",
        ],
        derivation_count=3,
        question="In which city does the student of Dario Penn's student perform every winter? "
        "Please answer in the format 'The city is ______.'",
        answer="Aldenhall",
    ),
    dict(
        derivations=[
            "The red ferry carries mail to the island of Skelde.",
            "The postmaster of Skelde is Ottilie Brask.",
            "Ottilie Brask breeds grey ponies.",
        ],
        derivation_count=3,
        question="What animals does the postmaster of the island served by the red ferry breed? "
        "Please answer in the format 'The postmaster breeds ______.'",
        answer="grey ponies",
    ),
    dict(
        derivations=[
            "Rowan Hale is the father of Esme Hale.",
            "Esme Hale is the mother of Corin Ashdown.",
            "Corin Ashdown is the father of Wren Ashdown.",
            "Wren Ashdown keeps a garden of saffron crocuses.",
        ],
        derivation_count=4,
        question="What does the great-grandchild of Rowan Hale grow in the garden? Please answer in the format "
        "'The garden has ______.'",
        answer="saffron crocuses",
    ),
]
