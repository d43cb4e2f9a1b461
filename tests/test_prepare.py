"""prepare.py: every loading path on real local text, the uint32 path, and Hugging Face via a fake
`datasets`."""
import collections
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

import prepare
from prepare import get_tokenizer, token_dtype


def load(folder):
    meta = json.loads((folder / 'meta.json').read_text(encoding='utf-8'))
    train = np.fromfile(folder / 'train.bin', dtype=meta['dtype'])
    val = np.fromfile(folder / 'val.bin', dtype=meta['dtype'])
    return meta, train, val


def load_prepared(dataset, tmp_path, **kw):
    prepare.prepare(dataset, out_dir=str(tmp_path / 'data'), **kw)
    return load(tmp_path / 'data' / dataset)


def one_line_error(capsys, excinfo):
    err = capsys.readouterr().err
    assert excinfo.value.code not in (0, None)
    assert err.startswith('error: ') and err.count('\n') == 1, err
    return err


# ---- tinyshakespeare, the two tokenizers ----

def use_offline_shakespeare(offline_data, monkeypatch):
    # the real download path, reading the offline copy through a file:// URL (urllib opens both)
    monkeypatch.setattr(prepare, 'SHAKESPEARE_URL', (offline_data / 'tinyshakespeare' / 'input.txt').as_uri())


def test_shakespeare_char_reproduces_nanogpt_split(offline_data, tmp_path, monkeypatch):
    use_offline_shakespeare(offline_data, monkeypatch)
    meta, train, val = load_prepared('shakespeare_char', tmp_path)
    assert (tmp_path / 'data' / 'shakespeare_char' / 'input.txt').is_file()  # downloaded once, kept
    # nanoGPT's data/shakespeare_char/prepare.py prints exactly these numbers
    assert meta['vocab_size'] == 65 and meta['tokenizer'] == 'char' and meta['dtype'] == 'uint16'
    assert (len(train), len(val)) == (1_003_854, 111_540)
    assert (meta['train_tokens'], meta['val_tokens']) == (len(train), len(val))
    encode, decode = get_tokenizer(meta)
    text = (offline_data / 'tinyshakespeare' / 'input.txt').read_text(encoding='utf-8')
    assert decode(train.tolist()) + decode(val.tolist()) == text      # lossless round trip


def test_shakespeare_gpt2_token_counts(offline_data, tmp_path, monkeypatch):
    use_offline_shakespeare(offline_data, monkeypatch)
    meta, train, val = load_prepared('shakespeare', tmp_path)
    assert meta['vocab_size'] == 50257 and meta['tokenizer'] == 'gpt2' and meta['dtype'] == 'uint16'
    assert (len(train), len(val)) == (301_966, 36_059)                 # nanoGPT's data/shakespeare numbers
    encode, decode = get_tokenizer(meta)
    text = (offline_data / 'tinyshakespeare' / 'input.txt').read_text(encoding='utf-8')
    # the whole file
    assert len(encode(text)) == 338_025
    assert decode(train.tolist()) + decode(val.tolist()) == text


def encoded_in_pieces(encode, text, size):
    ids = list(prepare.encode_pieces(encode, text, 'test', size=size))
    return [i for piece in ids for i in piece], len(ids)


def test_tokenizing_piece_by_piece_gives_the_same_ids(offline_data):
    # long texts are encoded in pieces (with a progress bar); cut where the code cuts, the ids are exactly
    # those of the whole text, for characters and for GPT-2 BPE
    text = (offline_data / 'tinyshakespeare' / 'input.txt').read_text(encoding='utf-8')[:200_000]
    tricky = 'a\n\n\nb  \n c\t\nd\u00a0\ne\n\u3000f\r\ng\nh \n\n' * 50 + "x\n's\n\n 1\n2\n"
    stoi = {c: i for i, c in enumerate(sorted(set(text + tricky)))}
    enc = prepare.gpt2_encoding()
    for encode in (lambda s: [stoi[c] for c in s], enc.encode_ordinary):
        for t in (text, tricky):
            ids, n_pieces = encoded_in_pieces(encode, t, size=97)
            assert ids == encode(t) and n_pieces > 10
    # cutting after every newline instead would not be exact: GPT-2 has one token for '\n\n'
    assert enc.encode_ordinary('a\n\n\nb') != enc.encode_ordinary('a\n') + enc.encode_ordinary('\n\nb')


def test_gpt2_tokenizer_is_gpt2(offline_data):
    encode, decode = get_tokenizer({'tokenizer': 'gpt2', 'dataset': 'x'})
    assert encode('hello world') == [31373, 995]
    assert decode([31373, 995, 50300]) == 'hello world'                # padded-vocab ids have no text


def test_char_tokenizer_round_trip_and_unknown_character():
    encode, decode = get_tokenizer({'tokenizer': 'char', 'dataset': 'abc', 'itos': ['\n', 'a', 'b', 'c']})
    assert encode('ab\nc') == [1, 2, 0, 3] and decode([3, 2, 1]) == 'cba'
    with pytest.raises(ValueError, match="not in the abc vocabulary"):
        encode('abz')


# ---- local files and folders ----

def test_gutenberg_folder_is_sorted_joined_and_crlf_free(offline_data, tmp_path):
    books = tmp_path / 'books'
    books.mkdir()
    for name in ('pg1974.txt', 'pg1656.txt'):  # Poetics (22,064 GPT-2 tokens) and Apology (21,561)
        shutil.copy(offline_data / 'gutenberg' / name, books / name)
    (books / 'notes.md').write_text('not a .txt file: ignored')
    meta, train, val = load_prepared('gutenberg2', tmp_path, input_path=str(books), tokenizer='gpt2')
    # per-book token counts listed with the offline copies; the 90/10 cut may split one token in two
    assert abs(len(train) + len(val) - (21_561 + 22_064)) <= 2
    _, decode = get_tokenizer(meta)
    text = decode(train.tolist()) + decode(val.tolist())
    assert '\r' not in text
    assert text.startswith('Apology')                                  # pg1656 sorts before pg1974
    meta_c, train_c, val_c = load_prepared('gutenberg2_char', tmp_path, input_path=str(books),
                                           tokenizer='char')
    assert len(train_c) + len(val_c) == len(text) and '\r' not in meta_c['itos']


def test_input_file_with_default_tokenizer_for_a_new_name_is_gpt2(offline_data, tmp_path):
    src = tmp_path / 'mine.txt'
    src.write_text('Hello world.\r\n' * 50, encoding='utf-8')
    meta, train, val = load_prepared('mine', tmp_path, input_path=str(src))
    assert meta['tokenizer'] == 'gpt2' and meta['dataset'] == 'mine'
    assert 'itos' not in meta


def test_vocab_over_65535_is_written_as_uint32(tmp_path):
    assert (token_dtype(65_535), token_dtype(65_536), token_dtype(50_257)) == ('uint16', 'uint32', 'uint16')
    # 70,000 distinct characters (no surrogates) -> a char vocabulary that uint16 cannot index
    chars = [chr(i) for i in range(0x4E00, 0x4E00 + 70_000) if not 0xD800 <= i < 0xE000]
    src = tmp_path / 'wide.txt'
    src.write_text(''.join(chars) * 2, encoding='utf-8')
    meta, train, val = load_prepared('wide', tmp_path, input_path=str(src), tokenizer='char')
    assert meta['vocab_size'] == len(chars) > 65_535 and meta['dtype'] == 'uint32'
    assert os.path.getsize(tmp_path / 'data' / 'wide' / 'train.bin') == 4 * len(train)
    assert train.max() > 65_535 or val.max() > 65_535
    _, decode = get_tokenizer(meta)
    assert decode(train.tolist()) + decode(val.tolist()) == ''.join(chars) * 2


def test_val_fraction_sets_the_split(tmp_path):
    src = tmp_path / 't.txt'
    src.write_text('abcdefghij' * 100, encoding='utf-8')
    meta, train, val = load_prepared('t', tmp_path, input_path=str(src), tokenizer='char', val_fraction=0.25)
    assert (len(train), len(val)) == (750, 250)


# ---- the download path, without the network ----

def test_tinyshakespeare_is_downloaded_once_and_kept(tmp_path, monkeypatch, capsys):
    urls = []
    data = b'First Citizen:\nBefore we proceed any further, hear me speak.\n' * 20

    class Response:  # what urlopen returns: read(n) in chunks, and the size in a header
        headers = {'Content-Length': str(len(data))}
        def __init__(self, url, timeout):
            urls.append(url)
            self.body = io.BytesIO(data)
        def read(self, n=-1):
            return self.body.read(n)
        def __enter__(self):
            return self
        def __exit__(self, *a):
            return False

    monkeypatch.setattr(prepare.urllib.request, 'urlopen', Response)
    meta, train, val = load_prepared('shakespeare_char', tmp_path)
    assert urls == [prepare.SHAKESPEARE_URL] and len(train) + len(val) == 61 * 20
    assert (tmp_path / 'data' / 'shakespeare_char' / 'input.txt').read_bytes() == data  # nanoGPT's place
    assert '1.22k/1.22k' in capsys.readouterr().err                     # the progress bar, in bytes
    load_prepared('shakespeare_char', tmp_path)                          # second time: the saved copy
    assert len(urls) == 1


def test_download_failure_is_one_line_naming_the_offline_command(tmp_path, monkeypatch, capsys):
    # train.py prepares shakespeare_char itself and passes this error on: the hint must be a command
    # that works as written (train.py has no --input flag, prepare.py does)
    def offline(url, timeout):
        raise OSError('[Errno -2] Name or service not known')
    monkeypatch.setattr(prepare.urllib.request, 'urlopen', offline)
    with pytest.raises(SystemExit) as e:
        prepare.prepare('shakespeare', out_dir=str(tmp_path / 'data'))
    assert 'python prepare.py shakespeare --input=PATH/input.txt' in one_line_error(capsys, e)


# ---- Hugging Face datasets through a fake `datasets` module ----

WIKI = {'train': [' = Valkyria Chronicles = \n', '', ' Senjō no Valkyria is a game .\n', ''] * 300,
        'validation': [' = Robert Boulter = \n', '', ' He is an English actor .\n'] * 40}


def fake_datasets(monkeypatch, load_dataset):
    calls = []
    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return load_dataset(*args, **kwargs)
    monkeypatch.setitem(sys.modules, 'datasets', types.SimpleNamespace(load_dataset=recording))
    return calls


def test_wikitext103_joins_lines_of_each_hf_split(offline_data, tmp_path, monkeypatch):
    calls = fake_datasets(monkeypatch, lambda *a, split, **k: [{'text': t} for t in WIKI[split]])
    meta, train, val = load_prepared('wikitext103', tmp_path)
    assert [c[0] for c in calls] == [('Salesforce/wikitext', 'wikitext-103-raw-v1')] * 2
    assert [c[1]['split'] for c in calls] == ['train', 'validation']
    _, decode = get_tokenizer(meta)
    assert decode(train.tolist()) == ''.join(WIKI['train'])
    assert decode(val.tolist()) == ''.join(WIKI['validation'])
    assert meta['tokenizer'] == 'gpt2' and meta['train_tokens'] == len(train)


def test_fineweb_edu_streams_documents_with_eot_and_num_docs(offline_data, tmp_path, monkeypatch):
    def stream(*a, **k):
        for i in range(10_000):  # a "stream" far longer than asked for: num_docs must stop it
            yield {'text': f'Document number {i} is about photosynthesis.'}
    calls = fake_datasets(monkeypatch, stream)
    meta, train, val = load_prepared('fineweb_edu', tmp_path, num_docs=50)
    assert calls[0][0] == ('HuggingFaceFW/fineweb-edu',)
    assert calls[0][1] == {'name': 'sample-10BT', 'split': 'train', 'streaming': True}
    eot = 50256
    assert (train == eot).sum() == 45 and (val == eot).sum() == 5      # every 10th document is held out
    _, decode = get_tokenizer(meta)
    docs = decode(val.tolist()).split('<|endoftext|>')
    assert docs[:2] == ['Document number 9 is about photosynthesis.',
                        'Document number 19 is about photosynthesis.']


def test_a_failed_rerun_leaves_no_meta_json_vouching_for_other_files(offline_data, tmp_path, monkeypatch,
                                                                     capsys):
    fake_datasets(monkeypatch, lambda *a, **k: iter([{'text': 'one'}, {'text': 'two'}]))
    (tmp_path / 'data' / 'fineweb_edu').mkdir(parents=True)
    (tmp_path / 'data' / 'fineweb_edu' / 'meta.json').write_text('{"from": "an earlier run"}')
    # 2 documents: val (every 10th) is empty
    with pytest.raises(SystemExit) as e:
        prepare.prepare('fineweb_edu', out_dir=str(tmp_path / 'data'), num_docs=2)
    last = capsys.readouterr().err.splitlines()[-1]                     # after tqdm's progress bar
    assert last.startswith('error: ') and 'val split is empty' in last
    assert not (tmp_path / 'data' / 'fineweb_edu' / 'meta.json').exists()


def test_missing_datasets_package_is_one_line_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, 'datasets', None)  # import datasets -> ImportError
    with pytest.raises(SystemExit) as e:
        prepare.prepare('wikitext103', out_dir=str(tmp_path / 'data'))
    assert 'pip install datasets' in one_line_error(capsys, e)


def test_hub_failure_is_one_line_error(offline_data, tmp_path, monkeypatch, capsys):
    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub "
                              "(LocalEntryNotFoundError)\nmore")
    fake_datasets(monkeypatch, offline)
    with pytest.raises(SystemExit) as e:
        prepare.prepare('wikitext103', out_dir=str(tmp_path / 'data'))
    assert "Couldn't reach" in one_line_error(capsys, e)


# ---- paper 1's word-level tokenizer (wikitext103_word) ----

PATTERN = r"\s+|[A-Za-z0-9_]+|[^\w\s]"   # paper 1's, written out here independently of prepare.py


def test_word_vocabulary_rule_counts_min_count_top_k_and_ties():
    texts = ['b a a c, c c\n', 'a b  d d e ô!']          # counted text by text
    # tokens: ' ' 9, 'a' 3, 'c' 3, 'b' 2, 'd' 2, '  ' 1, ',' 1, '\n' 1, 'e' 1, '!' 1; 'ô' matches nothing
    itos = prepare.word_vocab(texts, size=8, min_count=2)
    assert itos[:4] == ['<pad>', '<bos>', '<eos>', '<unk>'] and prepare.WORD_UNK == 3
    # count descending, ties by the token: 'a' before 'c', 'b' before 'd'; the 4 specials count in the size
    assert itos[4:] == [' ', 'a', 'c', 'b']
    assert prepare.word_vocab(texts, size=100, min_count=2)[4:] == [' ', 'a', 'c', 'b', 'd']  # count >= 2
    assert len(prepare.word_vocab(texts, size=100, min_count=1)) == 4 + 10
    meta = {'tokenizer': 'word', 'dataset': 'x', 'itos': itos}
    encode, decode = get_tokenizer(meta)
    assert encode('a  b\td') == [5, 3, 7, 3, 3]          # '  ', '\t' and 'd' are outside: one <unk> each
    assert decode(encode('b a c a')) == 'b a c a'               # known tokens round trip
    assert decode([5, 3, 6]) == 'a<unk>c' and decode([6, 20_000]) == 'c'   # padded-vocab ids have no text
    assert encode('aô a') == encode('a a')                       # non-ASCII letters are in no token: dropped


def test_word_tokens_join_exactly_across_pieces_of_rows():
    rows = ['x\u00a0 y\n', ' z\n', '\n', '  \t', 'ab', 'c d ', ' = = H = = \n', 'é q'] * 40
    itos = prepare.word_vocab(rows, min_count=1)
    encode = prepare.word_encoder(itos)
    for n in (1, 3, 7, 1000):
        ids = [i for piece in prepare.encode_joined(encode, rows, n=n) for i in piece]
        assert ids == encode('\n\n'.join(rows)), n


def test_protocol_windows_and_steps():
    # windows of 257 tokens (256 inputs + the next-token target) starting every 128 tokens
    W, S = prepare.WINDOW, prepare.STRIDE
    assert (W, S, prepare.EPOCHS) == (256, 128, 4)
    lengths = (100, W + 1, W + S, W + S + 1, W + 10 * S + 1)
    assert [prepare.protocol_windows(T) for T in lengths] == [1, 1, 1, 2, 11]
    assert prepare.protocol_windows(1_000_000) == (1_000_000 - W - 1) // S + 1 == 7811
    assert prepare.protocol_steps(1_000_000, 64) == 4 * 123                     # ceil(7811 / 64) per epoch
    assert prepare.protocol_steps(1_000_000, 32) == 4 * 245
    assert prepare.protocol_steps(W + 64 * S + 1, 64) == 4 * 2                  # 65 windows: a partial batch


def paper_preset(repo_dir, size):
    ns = {}
    exec((repo_dir / 'config' / f'paper_{size}.py').read_text(), {}, ns)
    return ns


@pytest.mark.parametrize('size', ['44m', '129m'])
def test_paper_presets_train_the_reference_protocol_length(repo_dir, size):
    cfg = paper_preset(repo_dir, size)
    batch = cfg['batch_size'] * cfg['gradient_accumulation_steps']
    assert cfg['dataset'] == 'wikitext103_word' and 'vocab_size' not in cfg  # meta.json's vocabulary
    assert batch == prepare.PAPER_BATCH[size] and cfg['block_size'] == prepare.WINDOW
    # T is estimated: WikiText-103's published train size, ~2 pattern tokens per published token
    assert prepare.WIKITEXT103_WORD_TOKENS == 2 * prepare.WIKITEXT103_WORDS == 2 * 103_227_021
    T = prepare.WIKITEXT103_WORD_TOKENS
    assert cfg['max_iters'] == prepare.EPOCHS * math.ceil(((T - 257) // 128 + 1) / batch)
    assert cfg['max_iters'] == prepare.protocol_steps(T, batch)
    assert f"= {cfg['max_iters']:,} steps" in (repo_dir / 'config' / f'paper_{size}.py').read_text()


def test_input_text_with_the_word_tokenizer(offline_data, tmp_path, capsys):
    src = offline_data / 'gutenberg' / 'pg1656.txt'
    meta, train, val = load_prepared('apology', tmp_path, input_path=str(src), tokenizer='word')
    text = src.read_text(encoding='utf-8').replace('\r\n', '\n')
    counts = collections.Counter(re.findall(PATTERN, text))          # the whole text, train and val
    kept = sorted((t for t, c in counts.items() if c >= 2), key=lambda t: (-counts[t], t))
    assert len(kept) < 20_000 - 4 and meta['itos'] == ['<pad>', '<bos>', '<eos>', '<unk>', *kept]
    assert meta['tokenizer'] == 'word' and meta['vocab_size'] == len(meta['itos'])
    assert meta['dtype'] == 'uint16' and train.dtype == np.uint16
    assert max(train.max(), val.max()) < meta['vocab_size']
    n_unk = sum(c for t, c in counts.items() if c < 2)                # each token seen once is an <unk>
    assert abs((train == 3).sum() + (val == 3).sum() - n_unk) <= 2
    # the 90/10 cut by characters may split one token in two
    assert abs(len(train) + len(val) - sum(counts.values())) <= 1
    out = capsys.readouterr().out
    n = len(train)
    assert f"{(n - 257) // 128 + 1:,} windows of 256 tokens at stride 128 per epoch" in out
    assert f"max_iters={4 * math.ceil(((n - 257) // 128 + 1) / 64)} at batch 64 (44m)" in out


def test_wikitext103_word_reads_hf_rows_like_the_reference(offline_data, tmp_path, monkeypatch, capsys):
    # the real loading path, `datasets` replaced by rows of a real local text (lines of a book, blank lines as
    # WikiText's empty rows): train is most of the lines, validation the rest
    lines = (offline_data / 'gutenberg' / 'pg1974.txt').read_text(encoding='utf-8').replace('\r\n', '\n')
    lines = [line + '\n' if line.strip() else '' for line in lines.split('\n')]
    rows = {'train': lines[:-300], 'validation': lines[-300:]}
    calls = fake_datasets(monkeypatch, lambda *a, split, **k: [{'text': t} for t in rows[split]])
    meta, train, val = load_prepared('wikitext103_word', tmp_path)
    assert {c[0] for c in calls} == {('Salesforce/wikitext', 'wikitext-103-raw-v1')}
    assert {c[1]['split'] for c in calls} == {'train', 'validation'}
    # the vocabulary: counted row by row over train + validation, empty rows dropped
    counts = collections.Counter(t for r in rows['train'] + rows['validation']
                                 for t in re.findall(PATTERN, r))
    kept = sorted((t for t, c in counts.items() if c >= 2), key=lambda t: (-counts[t], t))
    assert meta['itos'] == ['<pad>', '<bos>', '<eos>', '<unk>', *kept[:20_000 - 4]]
    assert meta['tokenizer'] == 'word' and meta['dtype'] == 'uint16'
    assert meta['vocab_size'] == len(meta['itos'])
    # the data: the non-empty rows joined by a blank line, no other marks; where two rows meet ('\n' +
    # '\n\n' + the next row's start) the whitespace run was never counted, so it is an <unk>
    _, decode = get_tokenizer(meta)
    for split, ids in (('train', train), ('validation', val)):
        joined = '\n\n'.join(r for r in rows[split] if r)
        toks = re.findall(PATTERN, joined)
        stoi = {t: i for i, t in enumerate(meta['itos'])}
        assert ids.tolist() == [stoi.get(t, 3) for t in toks]
        assert decode(ids.tolist()) == ''.join(t if t in stoi else '<unk>' for t in toks)
    assert '\n\n\n' not in meta['itos'] and (train == 3).sum() >= sum(1 for r in rows['train'] if r) - 1
    out = capsys.readouterr().out
    assert 'train.bin' in out and '<unk>' in out and "paper 1's protocol" in out


# ---- bad input: one line on stderr, non-zero exit, no traceback ----

@pytest.mark.parametrize('argv, says', [
    (['nosuchset'], "unknown dataset 'nosuchset'"),
    (['mine', '--input', 'missing.txt'], 'no such file'),
    (['mine', '--input', 'empty.txt'], 'empty'),
    (['mine', '--input', 'emptydir'], 'no .txt files'),
    (['mine', '--input', 'latin1.txt'], 'not UTF-8'),
    (['mine', '--input', 'a.txt', '--tokenizer', 'bpe'], 'choose one of char, gpt2, word'),
    (['mine', '--input', 'a.txt', '--val_fraction', '1.5'], 'between 0 and 1'),
    (['mine', '--input', 'tiny.txt', '--tokenizer', 'char'], 'train split empty'),
    (['fineweb_edu', '--num_docs', '0'], 'must be >= 1'),
    (['wikitext103', '--tokenizer', 'char'], 'gpt2 only'),
    (['wikitext103_word', '--tokenizer', 'gpt2'], 'word only'),
    (['../escape', '--input', 'a.txt'], 'plain folder name'),
    (['mine', '--inptu', 'a.txt'], 'unrecognized arguments'),
])
def test_bad_input_is_one_line_error(tmp_path, monkeypatch, capsys, argv, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'empty.txt').write_text('')
    (tmp_path / 'emptydir').mkdir()
    (tmp_path / 'latin1.txt').write_bytes('café'.encode('latin-1'))
    (tmp_path / 'a.txt').write_text('some text\n' * 10)
    (tmp_path / 'tiny.txt').write_text('a')
    with pytest.raises(SystemExit) as e:
        prepare.main(argv)
    assert says in one_line_error(capsys, e)


def test_cli_error_has_no_traceback(repo_dir, tmp_path):
    r = subprocess.run([sys.executable, str(repo_dir / 'prepare.py'), 'nosuchset'], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.count('\n') == 1 and 'Traceback' not in r.stderr




# ---- missing data: the error's command prepares it ----

def commands(err):
    """The prepare.py commands an error message quotes, as prepare.main's arguments."""
    return [c.split()[2:] for c in re.findall(r'`(python prepare\.py [^`]*)`', err)]


def test_a_mistyped_dataset_names_the_nearest_known_one_with_a_command_that_prepares_it(tmp_path, capsys):
    from conftest import tiny_text
    data = tmp_path / 'data'
    (data / 'shakespeare_char').mkdir(parents=True)
    (data / 'shakespeare_char' / 'input.txt').write_text(tiny_text(), encoding='utf-8')  # no download
    with pytest.raises(SystemExit) as e:
        prepare.open_data(str(data / 'shakespeare_chr'), 8)
    err = one_line_error(capsys, e)
    assert 'did you mean shakespeare_char?' in err
    known, own = commands(err)
    assert known == ['shakespeare_char', '--out_dir', str(data)]
    prepare.main(known)  # the command works: the data it names is then there
    assert prepare.open_data(str(data / 'shakespeare_char'), 8)['tokenizer'] == 'char'
    assert own == ['shakespeare_chr', '--input=PATH', '--out_dir', str(data)]  # a folder for your own text


def test_a_dataset_of_your_own_name_is_told_to_prepare_it_from_your_text(tmp_path, capsys):
    (tmp_path / 'mine.txt').write_text('to be or not to be ' * 200, encoding='utf-8')
    with pytest.raises(SystemExit) as e:
        prepare.load_meta(str(tmp_path / 'data' / 'my_plays'))
    err = one_line_error(capsys, e)
    assert 'did you mean' not in err  # prepare.py knows no name near it
    [cmd] = commands(err)
    assert cmd == ['my_plays', '--input=PATH', '--out_dir', str(tmp_path / 'data')]
    # with the text's path for PATH (and characters: GPT-2's BPE needs tiktoken's files, offline too)
    prepare.main([a.replace('PATH', str(tmp_path / 'mine.txt')) for a in cmd] + ['--tokenizer=char'])
    assert prepare.load_meta(str(tmp_path / 'data' / 'my_plays'))['vocab_size'] > 1
