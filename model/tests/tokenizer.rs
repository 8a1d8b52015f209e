//! The byte-level tokenizer and a Hugging Face `tokenizer.json`.

use kvd_model::tokenizer::Tokenizer;

#[test]
fn byte_level_round_trips_utf8() {
    let t = Tokenizer::Bytes;
    let ids = t.encode("héllo").unwrap();
    assert_eq!(ids, vec![104, 195, 169, 108, 108, 111]);
    assert_eq!(t.decode(&ids), "héllo");
    assert_eq!(t.vocab(), 256);
}

#[test]
fn hugging_face_tokenizer_json_is_used_when_given() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(
        &path,
        r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
            "pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
            "model":{"type":"WordLevel","vocab":{"[UNK]":0,"hello":1,"world":2,"kvd":3},"unk_token":"[UNK]"}}"#,
    )
    .unwrap();
    let t = Tokenizer::from_file(&path).unwrap();
    assert_eq!(t.vocab(), 4);
    assert_eq!(t.encode("hello kvd world nope").unwrap(), vec![1, 3, 2, 0]);
    let text = t.decode(&[1, 2]);
    assert!(text.contains("hello") && text.contains("world"), "{text}");
    // A file that is not a tokenizer is a clear error.
    std::fs::write(&path, b"{}").unwrap();
    let e = Tokenizer::from_file(&path).unwrap_err().to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
}
