"""The small, fixed body of knowledge the reference model learns.

Real-world facts (capitals, animal habitats, element symbols, word categories, opposites) kept as plain
data, so the generated corpus, the held-out suites and their answer keys all come from one place.
Everything here is public general knowledge written out by us.
"""

from __future__ import annotations

# country -> (capital, continent)
COUNTRIES: dict[str, tuple[str, str]] = {
    "France": ("Paris", "Europe"), "Germany": ("Berlin", "Europe"), "Italy": ("Rome", "Europe"),
    "Spain": ("Madrid", "Europe"), "Portugal": ("Lisbon", "Europe"), "Norway": ("Oslo", "Europe"),
    "Sweden": ("Stockholm", "Europe"), "Poland": ("Warsaw", "Europe"), "Greece": ("Athens", "Europe"),
    "Austria": ("Vienna", "Europe"), "Ireland": ("Dublin", "Europe"), "Finland": ("Helsinki", "Europe"),
    "Egypt": ("Cairo", "Africa"), "Kenya": ("Nairobi", "Africa"), "Nigeria": ("Abuja", "Africa"),
    "Ghana": ("Accra", "Africa"), "Morocco": ("Rabat", "Africa"), "Ethiopia": ("Addis Ababa", "Africa"),
    "Senegal": ("Dakar", "Africa"), "Uganda": ("Kampala", "Africa"),
    "Japan": ("Tokyo", "Asia"), "China": ("Beijing", "Asia"), "India": ("New Delhi", "Asia"),
    "Thailand": ("Bangkok", "Asia"), "Vietnam": ("Hanoi", "Asia"), "Nepal": ("Kathmandu", "Asia"),
    "Mongolia": ("Ulaanbaatar", "Asia"), "Iran": ("Tehran", "Asia"),
    "Canada": ("Ottawa", "North America"), "Mexico": ("Mexico City", "North America"),
    "Cuba": ("Havana", "North America"), "Jamaica": ("Kingston", "North America"),
    "Brazil": ("Brasilia", "South America"), "Peru": ("Lima", "South America"),
    "Chile": ("Santiago", "South America"), "Argentina": ("Buenos Aires", "South America"),
    "Colombia": ("Bogota", "South America"), "Ecuador": ("Quito", "South America"),
    "Australia": ("Canberra", "Oceania"), "Fiji": ("Suva", "Oceania"),
}

# animal -> (class, habitat, food)
ANIMALS: dict[str, tuple[str, str, str]] = {
    "lion": ("mammal", "grassland", "meat"), "zebra": ("mammal", "grassland", "grass"),
    "camel": ("mammal", "desert", "plants"), "polar bear": ("mammal", "arctic", "seals"),
    "otter": ("mammal", "river", "fish"), "beaver": ("mammal", "river", "bark"),
    "monkey": ("mammal", "jungle", "fruit"), "gorilla": ("mammal", "jungle", "leaves"),
    "goat": ("mammal", "mountain", "grass"), "whale": ("mammal", "ocean", "krill"),
    "dolphin": ("mammal", "ocean", "fish"), "bat": ("mammal", "cave", "insects"),
    "owl": ("bird", "forest", "mice"), "eagle": ("bird", "mountain", "fish"),
    "penguin": ("bird", "arctic", "fish"), "parrot": ("bird", "jungle", "seeds"),
    "ostrich": ("bird", "grassland", "plants"), "duck": ("bird", "pond", "plants"),
    "lizard": ("reptile", "desert", "insects"), "crocodile": ("reptile", "river", "meat"),
    "turtle": ("reptile", "pond", "plants"), "snake": ("reptile", "forest", "mice"),
    "frog": ("amphibian", "pond", "insects"), "salamander": ("amphibian", "forest", "worms"),
    "shark": ("fish", "ocean", "fish"), "salmon": ("fish", "river", "insects"),
    "ant": ("insect", "forest", "seeds"), "bee": ("insect", "meadow", "nectar"),
    "butterfly": ("insect", "meadow", "nectar"), "beetle": ("insect", "forest", "leaves"),
}

# element -> symbol
ELEMENTS: dict[str, str] = {
    "hydrogen": "H", "helium": "He", "carbon": "C", "nitrogen": "N", "oxygen": "O", "sodium": "Na",
    "magnesium": "Mg", "aluminium": "Al", "silicon": "Si", "sulfur": "S", "chlorine": "Cl",
    "potassium": "K", "calcium": "Ca", "iron": "Fe", "copper": "Cu", "zinc": "Zn", "silver": "Ag",
    "gold": "Au", "tin": "Sn", "lead": "Pb", "mercury": "Hg", "neon": "Ne", "argon": "Ar", "nickel": "Ni",
}

# category -> members
CATEGORIES: dict[str, list[str]] = {
    "fruit": ["apple", "banana", "cherry", "mango", "pear", "plum", "grape", "lemon", "peach", "melon"],
    "vegetable": ["carrot", "potato", "onion", "cabbage", "pepper", "spinach", "turnip", "leek", "radish"],
    "tool": ["hammer", "saw", "wrench", "drill", "chisel", "shovel", "rake", "pliers", "axe"],
    "musical instrument": ["violin", "guitar", "piano", "flute", "trumpet", "drum", "cello", "harp", "oboe"],
    "vehicle": ["car", "bus", "train", "bicycle", "truck", "tram", "scooter", "boat", "plane"],
    "color": ["red", "blue", "green", "yellow", "purple", "orange", "brown", "pink", "gray"],
    "piece of furniture": ["chair", "table", "sofa", "bed", "desk", "shelf", "stool", "bench", "wardrobe"],
    "body part": ["hand", "knee", "elbow", "ankle", "shoulder", "finger", "wrist", "ear", "nose"],
}

OPPOSITES: dict[str, str] = {
    "hot": "cold", "big": "small", "fast": "slow", "happy": "sad", "early": "late", "light": "dark",
    "up": "down", "open": "closed", "full": "empty", "strong": "weak", "loud": "quiet", "rich": "poor",
    "young": "old", "wet": "dry", "hard": "soft", "high": "low", "thick": "thin", "near": "far",
    "clean": "dirty", "easy": "difficult", "long": "short", "heavy": "light", "wide": "narrow",
    "sweet": "sour", "push": "pull", "buy": "sell", "win": "lose", "first": "last",
}

NAMES = [
    "Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Leo",
    "Maya", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Will", "Yuki", "Zoe",
]

# item (plural) -> a place it is bought or kept; used by the word problems
ITEMS = [
    "apples", "marbles", "pencils", "stickers", "cookies", "books", "coins", "shells", "cards", "eggs",
    "flowers", "stamps", "candies", "toys", "balloons", "cupcakes", "buttons", "rocks", "beads", "muffins",
]

NONSENSE_QUESTIONS = [
    "What is the square root of a song?", "How heavy is the color blue?", "What does Tuesday taste like?",
    "How many corners does a whisper have?", "What is the phone number of the moon?",
    "Which number is the saddest?", "How tall is an idea?", "What is the smell of seven?",
]
