mod bytes;
pub use self::bytes::BytesCodec;

mod length;
pub use self::length::LengthCodec;

mod lines;
pub use self::lines::LinesCodec;

