//! `nodectl init` and `nodectl id`: a node's identity and data dir.

use anyhow::Result;
use serde_json::json;

use crate::cli::DataDirArgs;
use crate::store::Store;

pub(super) fn init(args: &DataDirArgs) -> Result<()> {
    let data = args.data_dir();
    let (key, created) = data.init()?;
    Store::open(&data.store_path())?;
    let peer_id = key.public().to_peer_id();
    if args.json {
        println!(
            "{}",
            json!({"peer_id": peer_id.to_string(), "data_dir": data.root(), "created": created})
        );
    } else if created {
        println!(
            "initialised {} with peer id {peer_id}",
            data.root().display()
        );
    } else {
        println!(
            "{} was already initialised; peer id {peer_id}",
            data.root().display()
        );
    }
    Ok(())
}

pub(super) fn id(args: &DataDirArgs) -> Result<()> {
    let data = args.data_dir();
    let peer_id = data.identity()?.public().to_peer_id();
    if args.json {
        println!("{}", json!({"peer_id": peer_id.to_string()}));
    } else {
        println!("{peer_id}");
    }
    Ok(())
}
